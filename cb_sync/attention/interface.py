"""The attention function registered with transformers' AttentionInterface, what a backend provides (`Backend`), and
backend selection."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from transformers import AttentionInterface

from . import sdpa_paged
from .metadata import AttnMetadata

ATTN_IMPLEMENTATION = "cb_sync_paged"


@runtime_checkable
class Backend(Protocol):
    """What the runner and the decode graphs use of an attention backend. A backend is a module (`sdpa_paged`,
    `triton_ops`, `flash_ops`, `batch_invariant.attention`), which satisfies this protocol by its names alone.

    DECODE_FOLLOWS_POOLS: a pure-decode step reaches the KV pools through `AttnMetadata.pool_offsets` at run time,
    so a graph captured over it stays valid when the pools come back elsewhere after a release; otherwise graphs
    record the pools' addresses and are captured again when those change."""

    DECODE_FOLLOWS_POOLS: bool

    def store_and_attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttnMetadata,
                         layer: int, scale: float, sliding_window: int | None = None,
                         softcap: float | None = None) -> torch.Tensor:
        """Write key/value [T, Hkv, D] into layer's pools at meta.slot_mapping (slots < 0 skipped), then return the
        causal paged attention [T, Hq, D] of query [T, Hq, D] over each request's cached context (padded requests,
        seq_len 0, as zeros).

        Args:
            query, key, value: the step's projections, one row a token.
            meta: the step's batch (`AttnMetadata`).
            layer: the decoder layer's index, which selects its pools.
            scale: the softmax scale.
            sliding_window: the attention window in positions, None for full attention.
            softcap: the logit soft-capping value (Gemma-2), None for none.

        Returns:
            The attention output, [T, Hq, D] in query's dtype.
        """


class MissingBatchMetadata(RuntimeError):
    """Paged attention called without the step's batch metadata (`cb_meta`): outside SyncCBDriver.generate(), or
    inside a model whose layers do not pass their keyword arguments on to attention."""


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, sliding_window: int | None = None, softcap: float | None = None,
                            cb_meta: AttnMetadata | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Store this step's K/V in the layer's paged cache, then attend over each request's cached context. query/key/value
    arrive as [1, heads, T, head_dim]; returns [1, T, heads, head_dim] as transformers expects."""
    if cb_meta is None:
        raise MissingBatchMetadata(f"{ATTN_IMPLEMENTATION} attention needs the cb_meta batch metadata; "
                           "it runs only inside SyncCBDriver.generate()")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{type(module).__name__} uses attention sinks (s_aux), which cb_sync's paged "
                                  "attention does not implement")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = cb_meta.backend.store_and_attend(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                           cb_meta, module.layer_idx, scale, sliding_window, softcap)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


@dataclass(frozen=True)
class StepBackends:
    """The attention backend of pure-decode steps and that of steps with prompt tokens (prefill and mixed)."""

    decode: Backend
    prefill: Backend


def select_backends(name: str, device: torch.device, dtype: torch.dtype) -> StepBackends:
    """Resolve "auto" | "sdpa_paged" | "triton" | "flash" | "flash_prefill" to the step kinds' backends for a model on
    `device` in `dtype`: auto is Triton on CUDA, else sdpa_paged; "flash_prefill" is flash-attn 4 for steps with
    prompt tokens and Triton for pure decode; the others serve every step. ValueError, naming what is missing, where
    a backend cannot run."""
    if name == "flash_prefill":
        try:
            return StepBackends(decode=_select("triton", device, dtype), prefill=_select("flash", device, dtype))
        except ValueError as error:
            raise ValueError(f"attn_backend='flash_prefill' runs flash-attn 4 and Triton's kernels: {error}") from None
    backend = _select(name, device, dtype)
    return StepBackends(decode=backend, prefill=backend)


def _select(name: str, device: torch.device, dtype: torch.dtype) -> Backend:
    if name == "sdpa_paged" or (name == "auto" and device.type != "cuda"):
        return sdpa_paged
    if name == "flash":
        from . import flash_ops
        reason = flash_ops.unavailable_reason(device, dtype)
        if reason is not None:
            raise ValueError(reason)
        return flash_ops
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attn_backend={name!r} needs a CUDA model for Triton's kernels (or TRITON_INTERPRET=1 for "
                         "tests)")
    from . import triton_ops
    return triton_ops
