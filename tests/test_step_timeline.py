"""benchmarks.step_timeline on a hand-made trace: busy time per phase, idle gaps by phase and host op, syncs."""

import gzip
import json

from benchmarks import step_timeline


def _x(name, cat, ts, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def test_idle_gaps_and_syncs_are_attributed(tmp_path):
    events = [
        _x("phase:_compute_loss", "user_annotation", 0, 100),
        _x("aten::linear", "cpu_op", 0, 40), _x("aten::mm", "cpu_op", 10, 20),
        _x("aten::item", "cpu_op", 60, 40), _x("cudaStreamSynchronize", "cuda_runtime", 65, 30),
        _x("phase:backward", "user_annotation", 100, 100),
        _x("aten::mul", "cpu_op", 150, 10, tid=2),          # the autograd engine's thread
        _x("gemm", "kernel", 20, 50), _x("add", "kernel", 110, 20), _x("copy", "gpu_memcpy", 180, 20),
    ]
    trace = tmp_path / "t.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = step_timeline.summarize(step_timeline.load(trace))
    assert (summary["wall_us"], summary["gpu_busy_us"], summary["idle_us"]) == (200, 90, 110)
    assert summary["phases"]["_compute_loss"] == [1, 100, 50]
    assert summary["phases"]["backward"] == [1, 100, 40]
    # gaps: 0-20 (mid 10: inside linear and mm), 70-110 (mid 90: in item), 130-180 (mid 155: mul on thread 2)
    assert summary["idle_by_op"] == {"aten::mm": 20, "aten::item": 40, "aten::mul": 50}
    assert summary["idle_by_phase"] == {"_compute_loss": 60, "backward": 50}
    assert summary["syncs"] == {"cudaStreamSynchronize | aten::item | _compute_loss": [1, 30]}
    text = step_timeline.report(summary)
    assert "backward | 1 | 0.1 | 0.0 | 60%" in text and "cudaStreamSynchronize | aten::item" in text


def test_a_child_ending_just_after_its_parent_stays_nested():
    ops = step_timeline.ThreadOps.of([_x("P", "cpu_op", 0, 100), _x("C", "cpu_op", 10, 90.001),
                                      _x("D", "cpu_op", 20, 5)])
    assert ops.parents == [-1, 0, 1]


def test_marked_phases_restores_the_trainer():
    class Accelerator:
        def backward(self, loss):
            return loss * 2

    class Trainer:
        accelerator = Accelerator()

        def training_step(self, x):
            return self.accelerator.backward(x) + 1

    trainer = Trainer()
    own_log = trainer.log = lambda *args: None       # an attribute set on the instance before the block
    with step_timeline.marked_phases(trainer):
        assert "training_step" in vars(trainer) and trainer.training_step(1) == 3 and trainer.log is not own_log
    assert "training_step" not in vars(trainer) and "backward" not in vars(trainer.accelerator)
    assert trainer.log is own_log
