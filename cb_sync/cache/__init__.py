"""Paged KV cache: block allocator, K/V pools, sizing."""

from .block_allocator import BlockAllocator
from .kv_cache import (STEP_HEADROOM_BYTES, PagedKVCache, blocks_at_once, blocks_for, blocks_to_allocate, device_room,
                       offsets_to_pools)

__all__ = ["BlockAllocator", "PagedKVCache", "STEP_HEADROOM_BYTES", "blocks_at_once", "blocks_for",
           "blocks_to_allocate", "device_room", "offsets_to_pools"]
