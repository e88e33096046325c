"""cb_sync.integrations.trl.training.gc_points: the garbage collector's objects collected and frozen at train begin,
after the first optimizer step and after any step a full collection ran in, never inside a step, and unfrozen when
training ends or fails; the trainer wires it in."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest

pytest.importorskip("trl")

from cb_sync.integrations.trl.training import gc_points  # noqa: E402
from cb_sync.integrations.trl.training.gc_points import GcPoints  # noqa: E402


@pytest.fixture
def events(monkeypatch):
    """Every collect and freeze gc_points makes, in order (the tests add the steps)."""
    seen = []
    gc.unfreeze()                        # whatever an earlier test left frozen
    monkeypatch.setattr(gc_points, "gc", SimpleNamespace(
        collect=lambda: seen.append("collect") or gc.collect(), freeze=lambda: seen.append("freeze") or gc.freeze(),
        unfreeze=gc.unfreeze, isenabled=gc.isenabled, get_freeze_count=gc.get_freeze_count, get_stats=gc.get_stats))
    yield seen
    gc.unfreeze()


def run_training(points: GcPoints, steps: int, events: list, fail_at: int | None = None,
                 full_collection_in: tuple[int, ...] = ()) -> list[int]:
    """Drives the callback as Trainer.train does, with a full collection of the collector's own inside the steps
    named; returns the freeze count seen at every step's begin."""
    state, frozen = SimpleNamespace(global_step=0), []
    with points.training():
        points.on_train_begin(None, state, None)
        for step in range(1, steps + 1):
            frozen.append(gc.get_freeze_count())
            events.append(f"step {step}")
            if step in full_collection_in:
                gc.collect()             # the real collector, as its thresholds would run it: not gc_points' own
            if step == fail_at:
                raise RuntimeError("a step failed")
            state.global_step = step
            points.on_step_end(None, state, None)
    return frozen


def test_collects_and_freezes_at_train_begin_and_after_the_first_step_only(events):
    points = GcPoints()
    frozen = run_training(points, 4, events)
    assert events == ["collect", "freeze", "step 1", "collect", "freeze", "step 2", "step 3", "step 4"]
    # objects frozen through every step (their count may drop: a frozen object freed by its refcount leaves it)
    assert all(count > 0 for count in frozen)
    assert gc.get_freeze_count() == 0 and not points.active          # unfrozen at train end
    events.clear()
    run_training(points, 2, events)                                  # a second train call starts over
    assert events == ["collect", "freeze", "step 1", "collect", "freeze", "step 2"]


def test_freezes_again_after_a_later_step_in_which_a_full_collection_ran(events):
    run_training(GcPoints(), 5, events, full_collection_in=(3,))
    assert events == ["collect", "freeze", "step 1", "collect", "freeze", "step 2", "step 3", "collect", "freeze",
                      "step 4", "step 5"]
    assert gc.get_freeze_count() == 0


def test_unfreezes_when_training_fails(events):
    with pytest.raises(RuntimeError, match="a step failed"):
        run_training(GcPoints(), 3, events, fail_at=2)
    assert events[-1] == "step 2" and gc.get_freeze_count() == 0


def test_leaves_a_disabled_collector_and_anothers_freeze_alone(events):
    gc.disable()
    try:
        run_training(GcPoints(), 2, events)
    finally:
        gc.enable()
    assert events == ["step 1", "step 2"]
    gc.freeze()                          # someone else's freeze
    frozen = gc.get_freeze_count()
    run_training(GcPoints(), 2, events)
    # still frozen: theirs (the count may drop, as a frozen object freed by its refcount leaves it; never to zero)
    assert events == ["step 1", "step 2"] * 2 and 0 < gc.get_freeze_count() <= frozen


def test_the_trainer_freezes_around_its_steps_and_can_leave_it_out(tmp_path, events):
    from test_integration_trl import dataset, even_fraction, grpo_args, tiny_model, tokenizer
    from transformers import TrainerCallback

    from cb_sync.integrations.trl import CBSyncGRPOTrainer

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            events.append(f"step {state.global_step + 1}")

    def trainer(**kwargs):
        return CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction, args=grpo_args(tmp_path, max_steps=2),
                                 train_dataset=dataset(), processing_class=tokenizer(), callbacks=[Steps()], **kwargs)
    on = trainer(freeze_gc=True)
    on.train()
    # a full collection of the collector's own during step 2 adds a collect and freeze after it
    assert events in (["collect", "freeze", "step 1", "collect", "freeze", "step 2"],
                      ["collect", "freeze", "step 1", "collect", "freeze", "step 2", "collect", "freeze"])
    assert gc.get_freeze_count() == 0
    off = trainer()                     # off by default
    assert off._gc_points is None and not any(isinstance(c, GcPoints) for c in off.callback_handler.callbacks)
    with pytest.raises(ValueError, match="freeze_gc must be True or False"):
        trainer(freeze_gc="yes")
