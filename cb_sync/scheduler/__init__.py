"""Requests, the FIFO scheduler and the step plan it emits."""

from .fifo import FIFOScheduler, Scheduler
from .plan import ScheduledChunk, StepColumns, step_columns
from .request import GenerationResult, Request, Status

__all__ = ["FIFOScheduler", "GenerationResult", "Request", "ScheduledChunk", "Scheduler", "Status", "StepColumns",
           "step_columns"]
