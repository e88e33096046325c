"""One driver call at a time on a model.

A generate() call changes what every driver of the model shares (its attention implementation, its modules'
training flags) and what its own driver holds (the KV cache, the graphs): calls from two threads would interleave
their steps over one cache and restore each other's settings. So generate() and release() on the drivers of one
model run one at a time, a second caller waiting for the first. A call made while one runs on the same thread (from
an observer) would wait for itself, so it is refused."""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import torch


class _CallLock:
    def __init__(self):
        self.lock = threading.Lock()
        self.owner: int | None = None       # the thread running a call


_locks: weakref.WeakKeyDictionary[torch.nn.Module, _CallLock] = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


@contextmanager
def one_call_at_a_time(model: torch.nn.Module, call: str):
    """Run the block once no other thread runs a call on `model`.

    Args:
        model: the model the call runs (the transformers model, under any PEFT wrapper).
        call: the call's name, for the error message.

    Raises:
        RuntimeError: a call on `model` is running on this thread already.
    """
    with _locks_guard:
        state = _locks.setdefault(model, _CallLock())
    this_thread = threading.get_ident()
    if state.owner == this_thread:
        raise RuntimeError(f"SyncCBDriver.{call}() was called while a generate() or release() on the same model runs "
                           "on this thread (from an observer?): calls on a model cannot nest; make the call after "
                           "the running one has returned")
    with state.lock:
        state.owner = this_thread
        try:
            yield
        finally:
            state.owner = None
