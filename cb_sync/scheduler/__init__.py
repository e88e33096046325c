"""FIFO scheduling of requests into steps."""

from .scheduler import ScheduledChunk, Scheduler

__all__ = ["ScheduledChunk", "Scheduler"]
