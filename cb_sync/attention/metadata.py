"""The batch description every attention backend reads: where each request's queries and KV blocks are."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..tuning import AttentionTuning

if TYPE_CHECKING:       # for the annotation only: the interface module names this one's class in its own
    from .interface import Backend


@dataclass
class AttnMetadata:
    """One step's flat batch of T query tokens from R requests.

    slot_mapping: int64 [T], cache slot (block * block_size + offset) each token's K/V is written to; -1 writes nothing.
    block_tables: int32 [R, max_blocks], each request's KV blocks in order (unused entries are ignored).
    seq_lens: int32 [R], each request's context length including this step's tokens; 0 marks a padded row.
    query_start_loc: int32 [R + 1], request r's queries are tokens query_start_loc[r]:query_start_loc[r + 1]
        (at least one: a padded row has one query); they sit at the last positions of its context.
    max_query_len, max_seq_len: host-side bounds of the above (upper bounds within the block tables' capacity,
        max_blocks * block_size, suffice; the Triton backend reads none, so a compiled step does not guard on them).
    k_caches, v_caches: per layer, [num_blocks, block_size, num_kv_heads, head_dim].
    backend: the attention backend that runs the step (`interface.Backend`).
    tuning: the Triton kernels' tile sizes.
    pool_offsets: int64 [num_layers, 2] on the device, where each layer's K and V pools lie
        (`PagedKVCache.pool_offsets`), or None; a backend may reach the pools through it so that a captured step
        follows them to new addresses.
    derived: what a backend derives from the above, once a step (in the first layer) for every layer."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    backend: Backend
    tuning: AttentionTuning = AttentionTuning()
    pool_offsets: torch.Tensor | None = None
    derived: dict = field(default_factory=dict, repr=False)
