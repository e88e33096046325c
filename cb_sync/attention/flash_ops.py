"""FlashAttention over the paged cache, through flash-attn 4's CuTe kernels (`flash_attn.cute`, an optional extra).

The step's K/V are written by cb_sync's Triton store kernel; FlashAttention's paged forward then reads the pools
through the block tables (its layout is the pools' own: [blocks, block_size, kv heads, head_dim]). A decode batch
runs as a batch of one query per request, other steps as varlen queries; both causal, bottom-right aligned, which
is cb_sync's convention (a request's queries are the last positions of its context). FlashAttention compiles a
kernel on first use of each shape, so a step is captured in a graph only after it ran once uncaptured (the
driver's warm-up does that). Its choices depend on shapes only (the block table's width, not the lengths), so a
captured step stays valid for every batch of its bucket; it records the pools' addresses, so graphs are captured
again when the pools move. Decode runs one KV split a (request, KV head): flash-attn 4 splits KV on sm100+ only."""

from __future__ import annotations

from typing import Optional

import torch

from . import triton_kernels
from .metadata import AttnMetadata
from .sdpa_paged import token_requests

DECODE_FOLLOWS_POOLS = False     # FlashAttention's kernels take the pools' addresses

INSTALL_HINT = ("install cb_sync's `flash` extra: pip install 'flash-attn-4>=4.0.0b36' "
                "'nvidia-cutlass-dsl[cu13]>=4.8' (FlashAttention 4 with nvidia-cutlass-dsl's CUDA 13 libraries)")


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this backend cannot run a model on `device` in `dtype`, or None when it can."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return (f"attn_backend='flash' needs a CUDA model in float16 or bfloat16 (flash-attn 4's kernels), got one on "
                f"{device.type} in {dtype}")
    try:
        from flash_attn.cute import flash_attn_varlen_func  # noqa: F401
    except Exception as error:       # ImportError, or a missing CUDA library raised as RuntimeError/OSError
        return f"attn_backend='flash' needs flash-attn 4 (flash_attn.cute), which could not be imported: {error!r}; " \
               + INSTALL_HINT
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10, 11):          # its sm80 and sm120 kernels take no paged KV
        return f"attn_backend='flash': flash-attn 4 has no paged-KV kernels for compute capability {major}.{minor}"
    return None


@torch.library.custom_op("cb_sync::flash_store_and_attend", mutates_args=("k_cache", "v_cache"))
def flash_store_and_attend_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                              seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                              sliding_window: Optional[int] = None, softcap: Optional[float] = None) -> torch.Tensor:
    """Write key/value [T, Hkv, D] into the caches at slot_mapping [T] (slots < 0 skipped), then return FlashAttention
    of query [T, Hq, D] over each request's cached context (padded requests, seq_len 0, as zeros)."""
    from flash_attn.cute import flash_attn_varlen_func
    triton_kernels.store_kv(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_reqs = query.shape[0], seq_lens.shape[0]
    common = dict(page_table=block_tables, seqused_k=seq_lens, softmax_scale=scale, causal=True,
                  window_size=(sliding_window - 1, 0) if sliding_window else (None, None), softcap=softcap or 0.0)
    if num_tokens == num_reqs:          # one query a request: a batch of single-row queries
        out = _output(flash_attn_varlen_func(query.unsqueeze(1), k_cache, v_cache, num_splits=1, **common))
        padded = (seq_lens == 0)[:, None, None]
        return out.squeeze(1).masked_fill(padded, 0.0)
    out = _output(flash_attn_varlen_func(query, k_cache, v_cache, cu_seqlens_q=query_start_loc, **common))
    _, token_req, _ = token_requests(query_start_loc, num_tokens)
    return out.masked_fill((seq_lens[token_req] == 0)[:, None, None], 0.0)


@flash_store_and_attend_op.register_fake
def _(query, key, value, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
      sliding_window=None, softcap=None) -> torch.Tensor:
    return query.new_empty(query.shape)


def _output(result) -> torch.Tensor:
    """The attention output of flash_attn_varlen_func's result (an output, or (output, lse))."""
    return result[0] if isinstance(result, tuple) else result


def store_and_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttnMetadata, layer: int,
                     scale: float, sliding_window: Optional[int] = None,
                     softcap: Optional[float] = None) -> torch.Tensor:
    """The backend entry point: store the step's K/V in layer's pools, then FlashAttention over meta's batch."""
    return flash_store_and_attend_op(query, key, value, meta.k_caches[layer], meta.v_caches[layer],
                                     meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                     scale, sliding_window, softcap)
