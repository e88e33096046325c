"""A step on the device: its inputs sent in one copy, and its output, read back when asked."""

from .buffers import StepBuffers
from .output import EagerOutput, StepOutput

__all__ = ["EagerOutput", "StepBuffers", "StepOutput"]
