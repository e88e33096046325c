"""Entering and leaving generation: attention implementation, eval mode, inference mode, rotary tables computed
once per compiled step; always restored."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from transformers import PreTrainedModel

from .attention import ATTN_IMPLEMENTATION
from .patching import base_model, module_list
from .rotary import rotary_tables_materialized


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


def _attention_setter(base: PreTrainedModel, modules: list[torch.nn.Module]) -> Callable[[str], None]:
    """`base.set_attn_implementation`, or the config's own setter where that does the same without the method's
    walk over the modules: no sub-configs and no submodel of another config class (text-only causal LMs).
    (`check_supported` made the full switch once.)"""
    if base.config.sub_configs or any(isinstance(m, PreTrainedModel) and type(m.config) is not type(base.config)
                                      for m in modules):
        return base.set_attn_implementation
    return lambda implementation: setattr(base.config, "_attn_implementation", implementation)


@contextmanager
def generation_mode(model: torch.nn.Module):
    """Run the model with paged attention, in eval and inference mode, its rotary tables computed once per compiled
    step (`rotary`); restore every module's training flag, the attention implementation and the rotary modules
    afterwards, also when the body raises. Yields the model's modules (`patching.module_list`), walked once a call."""
    base = base_model(model)
    modules = module_list(model)
    training = {id(module) for module in modules if module.training}
    previous = base.config._attn_implementation
    set_attention = _attention_setter(base, modules)         # decided once for entry and exit
    if previous != ATTN_IMPLEMENTATION:
        set_attention(ATTN_IMPLEMENTATION)
    try:
        if training:
            model.eval()
        with torch.inference_mode(), rotary_tables_materialized(modules):
            yield modules
    finally:
        if base.config._attn_implementation != previous:
            set_attention(previous)
        for module in modules:                # a flag is written only where it differs (a costly setattr)
            if module.training != (id(module) in training):
                module.training = id(module) in training
