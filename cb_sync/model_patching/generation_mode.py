"""Entering and leaving generation: attention implementation, eval mode, inference mode, rotary tables computed
once per compiled step; always restored."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import contextmanager

import torch
from transformers import PreTrainedModel

from ..attention import ATTN_IMPLEMENTATION
from .rotary import rotary_tables_materialized
from .swaps import base_model, module_list


def attention_implementations(config) -> list[tuple]:
    """(config, attention implementation) of a model's config and of its sub-configs at any depth (a composite
    model's submodels run on them), parents before their sub-configs."""
    found, seen = [], set()
    pending = deque([config])
    while pending:
        config = pending.popleft()
        if id(config) not in seen:
            seen.add(id(config))
            found.append((config, config._attn_implementation))
            pending.extend(sub for key in config.sub_configs if (sub := getattr(config, key, None)) is not None)
    return found


def restore_attention(recorded: list[tuple]) -> None:
    """Put back what `attention_implementations` recorded. A config's setter also sets its sub-configs, so parents
    go first and each sub-config then gets its own value back."""
    for config, implementation in recorded:
        if config._attn_implementation != implementation:
            config._attn_implementation = implementation


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
    afterwards, also when the body raises. Yields the model's modules (`swaps.module_list`), walked once a call."""
    base = base_model(model)
    modules = module_list(model)
    training = {id(module) for module in modules if module.training}
    previous = attention_implementations(base.config)
    if any(implementation != ATTN_IMPLEMENTATION for _, implementation in previous):
        _attention_setter(base, modules)(ATTN_IMPLEMENTATION)
    try:
        if training:
            model.eval()
        with torch.inference_mode(), rotary_tables_materialized(modules):
            yield modules
    finally:
        restore_attention(previous)
        for module in modules:                # a flag is written only where it differs (a costly setattr)
            if module.training != (id(module) in training):
                module.training = id(module) in training
