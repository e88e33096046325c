"""The block allocator's old path: it lives in `cb_sync.cache.block_allocator`."""

from ..cache.block_allocator import BlockAllocator

__all__ = ["BlockAllocator"]
