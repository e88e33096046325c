"""Executing a step's plan: the eager, compiled and replayed paths, and the step's output."""

from ..graphs import CompiledForward, DecodeReplay
from ..step import StepOutput
from .runner import ModelRunner

__all__ = ["CompiledForward", "DecodeReplay", "ModelRunner", "StepOutput"]
