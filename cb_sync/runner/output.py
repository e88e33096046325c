"""A step's output's old path: it lives in `cb_sync.step.output`."""

from ..step.output import EagerOutput, StepOutput

__all__ = ["EagerOutput", "StepOutput"]
