"""The KV cache's old path: the pools live in `cb_sync.cache.paged_cache`, the sizing in `cb_sync.cache.sizing`."""

from ..cache.paged_cache import PagedAttentionCache, PagedKVCache, offsets_to_pools
from ..cache.sizing import (MIN_STEP_HEADROOM_BYTES, attention_heads, blocks_at_once, blocks_for, blocks_to_allocate,
                            device_room, step_headroom)

__all__ = ["MIN_STEP_HEADROOM_BYTES", "PagedAttentionCache", "PagedKVCache", "attention_heads", "blocks_at_once",
           "blocks_for", "blocks_to_allocate", "device_room", "offsets_to_pools", "step_headroom"]
