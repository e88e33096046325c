"""Entering and leaving generation: attention implementation, eval mode, inference mode, rotary tables computed
once per compiled step; always restored."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .attention import ATTN_IMPLEMENTATION
from .graphs.rotary import rotary_tables_materialized


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers PreTrainedModel under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_supported(model: torch.nn.Module) -> None:
    """Refuse models whose attention does not go through transformers' AttentionInterface: they would run the
    flat batch as one sequence. Leaves the model as it was."""
    base = base_model(model)
    previous = base.config._attn_implementation
    base.set_attn_implementation(ATTN_IMPLEMENTATION)
    switched = base.config._attn_implementation == ATTN_IMPLEMENTATION
    base.set_attn_implementation(previous)
    if not switched:
        raise ValueError(f"{type(base).__name__} does not route attention through transformers' AttentionInterface, "
                         "so cb_sync cannot supply paged attention to it")


@contextmanager
def generation_mode(model: torch.nn.Module):
    """Run the model with paged attention, in eval and inference mode, its rotary tables computed once per compiled
    step (`graphs.rotary`); restore every module's training flag, the attention implementation and the rotary
    modules afterwards, also when the body raises."""
    base = base_model(model)
    modules = list(model.modules())       # one walk (~2 ms for a PEFT-wrapped 36-layer model), used three times
    training = {id(module) for module in modules if module.training}
    previous = base.config._attn_implementation
    if previous != ATTN_IMPLEMENTATION:
        base.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        if training:
            model.eval()
        with torch.inference_mode(), rotary_tables_materialized(modules):
            yield
    finally:
        if base.config._attn_implementation != previous:
            base.set_attn_implementation(previous)
        for module in modules:                # a flag is written only where it differs (a costly setattr)
            if module.training != (id(module) in training):
                module.training = id(module) in training
