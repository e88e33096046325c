"""The Triton kernels as opaque `torch.library` custom ops, so `torch.compile` calls them without tracing in.

`torch.ops.cb_sync.store_kv` mutates k_cache / v_cache in place; `torch.ops.cb_sync.paged_attention` returns a
new contiguous tensor. The fake implementations give shapes and dtypes for tracing and never launch anything.
Neither op takes a host-side int derived from the batch, so a compiled step runs prefill and decode batches of
any size without a guard to fail.
"""

from typing import Optional

import torch

from cb_sync.attention import triton_kernels
from cb_sync.attention.metadata import AttnMetadata


@torch.library.custom_op("cb_sync::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, Hkv, D] into the caches at slot_mapping [T]; slots < 0 are skipped."""
    triton_kernels.store_kv(key, value, k_cache, v_cache, slot_mapping)


@store_kv.register_fake
def _(key, value, k_cache, v_cache, slot_mapping) -> None:
    return None


@torch.library.custom_op("cb_sync::paged_attention", mutates_args=())
def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    sliding_window: Optional[int] = None, softcap: Optional[float] = None) -> torch.Tensor:
    """Causal paged attention of query [T, Hq, D]; see `triton_kernels.paged_attention`."""
    return triton_kernels.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                          sliding_window, softcap)


@paged_attention.register_fake
def _(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window=None,
      softcap=None) -> torch.Tensor:
    return query.new_empty(query.shape)


def attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata, scale: float,
           sliding_window: Optional[int] = None, softcap: Optional[float] = None) -> torch.Tensor:
    """The backend entry point: paged attention over meta's batch (its host-side bounds are not read)."""
    return paged_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                           sliding_window, softcap)
