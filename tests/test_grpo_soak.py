"""benchmarks.grpo's soak and first-step figures on the CPU: each step's end from the process start and the garbage
collector's runs in and between steps (GRPOStats), drift from the first to the last timed steps, the report's table,
backends in processes of their own and cb_sync run again with the compile caches its first run left."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from benchmarks import grpo  # noqa: E402
from benchmarks.grpo_stats import GRPOStats, report, soak_fields, soak_table  # noqa: E402
from benchmarks.harness import gc_pauses, process_age_s, since_process_start  # noqa: E402


def test_steps_end_at_times_from_the_process_start_and_split_the_collectors_runs():
    stats, state = GRPOStats("cb_sync", cuda=False), SimpleNamespace(global_step=0, max_steps=3)
    pauses = stats.pauses = [(0.0, 0.5)]                   # at train begin: before step 1
    for step, inside, after in ((1, [0.01, 0.03], [0.2, 0.1]), (2, [], [])):
        stats.on_step_begin(None, state, None)
        pauses += [(0.0, s) for s in inside]
        state.global_step = step
        stats.on_step_end(None, state, None)
        pauses += [(0.0, s) for s in after]
    first, second = stats.rows
    assert (first["gc_s"], first["gc_max_s"], first["gc_runs"]) == (pytest.approx(0.04), 0.03, 2)
    assert (first["gc_between_s"], first["gc_between_max_s"]) == (0.5, 0.5)
    assert (second["gc_s"], second["gc_runs"], second["gc_between_s"], second["gc_between_max_s"]) == (
        0.0, 0, pytest.approx(0.3), 0.2)
    assert 0 < first["at_s"] <= second["at_s"] <= since_process_start() <= process_age_s() + 1.0


def test_gc_pauses_records_each_run():
    import gc
    with gc_pauses() as pauses:
        gc.collect()
        gc.collect()
    assert len(pauses) >= 2 and all(seconds >= 0 for _, seconds in pauses)


def steps(n: int, slow_from: int = 99) -> list[dict]:
    return [{"step": i, "step_s": 2.0 if i >= slow_from else 1.0, "gen_s": 0.5, "peak_gib": 9.0 + 0.1 * i,
             "card_gib": 11.0, "gc_max_s": 0.15 if i == 2 else 0.001, "gc_between_max_s": 0.8 if i == 2 else 0.0}
            for i in range(1, n + 1)]


def test_drift_compares_the_first_and_last_timed_steps_and_flags_long_collections():
    fields = soak_fields(steps(12, slow_from=11), warmup=2, window=3)
    assert fields["drift"] == {"window": 3, "step_ms": [1000.0, 2000.0], "peak_gib": [9.5, 10.2],
                               "card_gib": [11.0, 11.0]}
    assert (fields["gc_max_ms"], fields["gc_max_ms_timed"], fields["gc_between_max_ms"]) == (150.0, 1.0, 800.0)
    assert fields["gc_steps_over_limit"] == [2]
    assert soak_fields(steps(3), warmup=1, window=10)["drift"]["window"] == 1      # at most half the timed steps
    assert "drift" not in soak_fields(steps(1), warmup=1, window=10)
    assert "gc_max_ms" not in soak_fields([{"step": 1, "step_s": 1.0}], warmup=0, window=10)   # rows of older runs


def test_the_report_has_first_steps_drift_and_pauses():
    row = {"engine": "cb_sync_compiled", "per_step": steps(12), "steps": 12, "batch": 4, "first_step_s": 92.54,
           "first_step_from": "process start", "compile_caches": "warm"}
    grpo.summarize(row, 2, drift_window=5)
    assert row["drift"]["window"] == 5 and row["gc_steps_over_limit"] == [2]
    table = soak_table([row, {"engine": "unsloth", "skipped": "no unsloth"}])
    assert ("| cb_sync_compiled (second run, compile caches warm) | 92.5 (from process start) | 5 | 1000 -> 1000 |"
            in table)
    assert "150 / 1 | 2 | 800 |" in table and "unsloth" not in table
    assert "## Time to first step, drift and garbage-collection pauses" in report([row], "# G", "text")


def test_jobs_and_their_compile_caches(monkeypatch):
    args = grpo.parse_args(["--tiny", "--backends", "cb_sync", "trl_generate", "unsloth", "--warm-rerun"])
    assert grpo.jobs_of(args) == [("cb_sync", 1, "cold"), ("trl_generate", 1, None), ("unsloth", 1, None),
                                  ("cb_sync", 1, "warm")]
    assert grpo.jobs_of(grpo.parse_args(["--tiny", "--backends", "cb_sync"])) == [("cb_sync", 1, None)]
    monkeypatch.setenv("TRITON_CACHE_DIR", "/theirs")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with grpo.fresh_compile_caches(True):
        inductor, triton = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]), Path(os.environ["TRITON_CACHE_DIR"])
        assert inductor.parent == triton.parent and inductor.parent.is_dir() and not any(inductor.parent.iterdir())
    assert not inductor.parent.exists() and os.environ["TRITON_CACHE_DIR"] == "/theirs"
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    args = grpo.parse_args(["--tiny", "--drift-window", "4", "--isolate", "--cb-freeze-gc", "off"])
    child = grpo.parse_args(grpo.child_argv(args, "cb_sync", None))
    assert (child.drift_window, child.cb_freeze_gc) == (4, "off")
    assert "--isolate" not in grpo.child_argv(args, "cb_sync", None)


@pytest.mark.slow
def test_warm_rerun_runs_cb_sync_twice_each_in_a_process_of_its_own(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    rows = grpo.main(["--tiny", "--backends", "cb_sync", "--steps", "2", "--warmup", "0", "--warm-rerun",
                      "--out", str(tmp_path)])
    assert [(r["engine"], r["compile_caches"], r.get("process")) for r in rows] == [
        ("cb_sync", "cold", "own"), ("cb_sync", "warm", "own")]
    for row in rows:
        assert "error" not in row, row.get("error")
        assert row["first_step_from"] == "process start"
        assert row["first_step_s"] == pytest.approx(row["per_step"][0]["at_s"], abs=0.06)
        assert row["drift"]["window"] == 1 and row["gc_steps_over_limit"] is not None
        assert all("gc_max_s" in s and "gc_between_s" in s for s in row["per_step"])
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    table = (tmp_path / "grpo_g.md").read_text()
    assert "| cb_sync (second run, compile caches warm) |" in table and "(from process start)" in table
