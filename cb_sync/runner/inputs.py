"""A step's inputs' old path: the plan's columns live in `cb_sync.scheduler.plan`, the buffers in `cb_sync.step`."""

from ..scheduler.plan import StepColumns, step_columns
from ..step.buffers import ALIGN, StepBuffers

__all__ = ["ALIGN", "StepBuffers", "StepColumns", "step_columns"]
