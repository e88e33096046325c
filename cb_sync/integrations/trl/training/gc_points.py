"""Python's cyclic garbage collector kept out of the training steps.

A full collection walks every object the collector tracks. Once transformers, TRL, torch.compile and the captured
decode graphs have built their state, a process holds millions of them, and a full collection that falls inside a
step stops the host, and with it the GPU's queue of work, for as long as the walk takes. Most of those objects live
for the whole run. So the trainer collects and then freezes (`gc.freeze`) what is alive at points of its choosing,
outside any step: when training begins (the model, the optimizer, the data), after the first optimizer step (whose
rollout and forwards compiled, captured and allocated what later steps reuse), and after any later step in which a
full collection ran: that step met work the first one did not (a new shape compiled, say), and what it left behind
would otherwise be walked again by every full collection to come. Collections after a freeze walk only what the run
made since.

A frozen object is never collected: one that later becomes unreachable through a reference cycle stays until
training ends, when everything frozen is unfrozen (errors included) and a later collection can reclaim it. The
trainer leaves the collector alone where it is disabled or where something else froze objects already
(`gc.get_freeze_count() > 0`): that choice stands.
"""

from __future__ import annotations

import contextlib
import gc

from transformers import TrainerCallback


class GcPoints(TrainerCallback):
    """Collects and freezes the collector's objects at train begin, after the first optimizer step, and after any step
    in which a full collection ran, while `training()` is entered; unfreezes them when it is left."""

    def __init__(self):
        self.active = False
        self.steps_seen = 0
        self.full_runs_at_freeze = 0

    @contextlib.contextmanager
    def training(self):
        """One `Trainer.train` call: freezes happen only inside it, and whatever was frozen is unfrozen at its end."""
        self.active, self.steps_seen = gc.isenabled() and gc.get_freeze_count() == 0, 0
        try:
            yield
        finally:
            if self.active:
                gc.unfreeze()
            self.active = False

    def freeze(self) -> None:
        if self.active:
            gc.collect()
            gc.freeze()
            self.full_runs_at_freeze = full_runs()

    def on_train_begin(self, args, state, control, **kwargs):
        self.freeze()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps_seen += 1
        if self.steps_seen == 1 or full_runs() > self.full_runs_at_freeze:
            self.freeze()


def full_runs() -> int:
    """The full collections (of the collector's oldest generation) this process has run."""
    return gc.get_stats()[-1]["collections"]
