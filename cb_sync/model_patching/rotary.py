"""Rotary tables computed once per compiled step.

A rotary embedding's cos/sin tables are cheap pointwise functions of the positions, so inductor inlines them into
every consumer: each layer's query and key kernels would evaluate a sine and a cosine per element. Passed through
an opaque op, the tables become buffers computed once per step and read by every layer."""

from __future__ import annotations

import torch

from .swaps import forwards_swapped


@torch.library.custom_op("cb_sync::materialize", mutates_args=())
def materialize(x: torch.Tensor) -> torch.Tensor:
    """x's values in a new tensor: a boundary torch.compile does not fuse across."""
    return x.clone()


@materialize.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _tables_materialized(forward):
    def wrapped(*args, **kwargs):
        out = forward(*args, **kwargs)
        if torch.compiler.is_compiling() and type(out) is tuple and all(isinstance(t, torch.Tensor) for t in out):
            return tuple(materialize(t) for t in out)
        return out
    wrapped.materializes_tables = True
    return wrapped


def rotary_tables_materialized(modules):
    """Within the block, the rotary-embedding modules (transformers' `*RotaryEmbedding`) among `modules` (a model's
    modules) hand their tables through `materialize` while torch.compile traces them; eager calls are unchanged."""
    rotary = [m for m in modules if type(m).__name__.endswith("RotaryEmbedding")
              and not getattr(m.forward, "materializes_tables", False)]      # not twice when nested
    return forwards_swapped(rotary, lambda module: _tables_materialized(module.forward))
