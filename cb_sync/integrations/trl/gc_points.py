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
        self.full_collections = 0

    @contextlib.contextmanager
    def training(self):
        """One `Trainer.train` call: freezes happen only inside it, and whatever was frozen is unfrozen at its end."""
        self.active, self.steps_seen = gc.isenabled() and gc.get_freeze_count() == 0, 0
        if self.active:
            gc.callbacks.append(self._count_full_collections)
        try:
            yield
        finally:
            if self.active:
                gc.callbacks.remove(self._count_full_collections)
                gc.unfreeze()
            self.active = False

    def _count_full_collections(self, phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:            # CPython's oldest generation: a full run
            self.full_collections += 1

    def freeze(self) -> None:
        if self.active:
            gc.collect()
            gc.freeze()
            self.full_collections = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.freeze()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps_seen += 1
        if self.steps_seen == 1 or self.full_collections:
            self.freeze()
