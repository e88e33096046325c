"""Paged KV cache: block allocator, K/V pools, sizing."""

from .block_allocator import BlockAllocator
from .kv_cache import (PagedKVCache, attention_heads, blocks_at_once, blocks_for, blocks_to_allocate, device_room,
                       offsets_to_pools, step_headroom)

__all__ = ["BlockAllocator", "PagedKVCache", "attention_heads", "blocks_at_once", "blocks_for", "blocks_to_allocate",
           "device_room", "offsets_to_pools", "step_headroom"]
