"""The Triton kernels as an opaque `torch.library` custom op, `torch.ops.cb_sync.store_and_attend`, so `torch.compile`
calls them without tracing in. The op takes no host-side int derived from the batch, so a compiled step runs prefill
and decode batches of any size without a guard to fail."""

from typing import Optional

import torch

from cb_sync.attention import triton_kernels
from cb_sync.attention.metadata import AttnMetadata
from cb_sync.tuning import AttentionTuning

DECODE_FOLLOWS_POOLS = True     # decode batches reach the pools through AttnMetadata.pool_offsets


@torch.library.custom_op("cb_sync::store_and_attend", mutates_args=("k_cache", "v_cache"))
def store_and_attend_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                        sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                        tuning: Optional[list[int]] = None,
                        pool_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Write key/value [T, Hkv, D] into the caches in place at slot_mapping [T] (slots < 0 are skipped), then return
    the causal paged attention of query [T, Hq, D] as a new contiguous tensor: `triton_kernels.paged_attention` with
    new_kv (whose slot condition for decode batches applies). tuning: an AttentionTuning's ints (None: the defaults).
    pool_offsets: int64 [2], where the caches lie (a row of `PagedKVCache.pool_offsets`), which decode batches reach
    them through."""
    return triton_kernels.paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                          sliding_window, softcap, new_kv=(key, value, slot_mapping),
                                          tuning=AttentionTuning(*tuning or ()), pool_offsets=pool_offsets)


@store_and_attend_op.register_fake
def _(query, key, value, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
      sliding_window=None, softcap=None, tuning=None, pool_offsets=None) -> torch.Tensor:
    return query.new_empty(query.shape)


def store_and_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttnMetadata, layer: int,
                     scale: float, sliding_window: Optional[int] = None,
                     softcap: Optional[float] = None) -> torch.Tensor:
    """The backend entry point: store the step's K/V in layer's pools, then paged attention over meta's batch (host
    bounds unread; decode batches reach the pools through meta.pool_offsets where it is given)."""
    offsets = None if meta.pool_offsets is None else meta.pool_offsets[layer]
    return store_and_attend_op(query, key, value, meta.k_caches[layer], meta.v_caches[layer], meta.slot_mapping,
                               meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, sliding_window, softcap,
                               meta.tuning.ints(), offsets)
