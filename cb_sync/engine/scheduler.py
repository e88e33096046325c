"""The scheduler's old path: it lives in `cb_sync.scheduler`."""

from ..scheduler.fifo import FIFOScheduler, Scheduler
from ..scheduler.plan import ScheduledChunk

__all__ = ["FIFOScheduler", "ScheduledChunk", "Scheduler"]
