"""The compiled forward's old path: it lives in `cb_sync.graphs.compiled`."""

from ..graphs.compiled import COMPILE_OPTIONS, CompiledForward, eager_forward, model_logits

__all__ = ["COMPILE_OPTIONS", "CompiledForward", "eager_forward", "model_logits"]
