"""One driver call at a time in a process.

A call changes what the drivers of its model share (the model's attention implementation, its modules' training
flags) and what its own driver holds (the KV cache, the graphs); and every driver on a GPU shares more: the Triton
decode kernel's arrival counters, CUDA graph capture (which fails if another thread launches work meanwhile) and the
compiler's settings. So the drivers' calls (construction, generate(), release()) run one at a time, a second thread
waiting for the first. A call made while one runs on the same thread (from an observer) would wait for itself, so it
is refused."""

from __future__ import annotations

import threading
from contextlib import contextmanager

_lock = threading.Lock()
_owner: int | None = None            # the thread running a call


@contextmanager
def one_call_at_a_time(call: str):
    """Run the block once no other thread runs a driver call.

    Args:
        call: the call's name, for the error message.

    Raises:
        RuntimeError: a driver call is running on this thread already.
    """
    global _owner
    this_thread = threading.get_ident()
    if _owner == this_thread:
        raise RuntimeError(f"SyncCBDriver.{call} was called while another driver call runs on this thread (from an "
                           "observer?): driver calls cannot nest; make the call after the running one has returned")
    with _lock:
        _owner = this_thread
        try:
            yield
        finally:
            _owner = None
