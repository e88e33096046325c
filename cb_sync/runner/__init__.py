"""Executing a step's plan: inputs, the eager, compiled and replayed paths, and the step's output."""

from .compiled import CompiledForward
from .cuda_graphs import DecodeReplay
from .output import StepOutput
from .runner import ModelRunner

__all__ = ["CompiledForward", "DecodeReplay", "ModelRunner", "StepOutput"]
