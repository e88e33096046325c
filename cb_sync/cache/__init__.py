"""The KV cache: the paged pools, the block allocator, and the KV manager that says which blocks a request holds."""

from .block_allocator import BlockAllocator
from .kv_manager import KVManager
from .paged_cache import PagedAttentionCache, PagedKVCache

__all__ = ["BlockAllocator", "KVManager", "PagedAttentionCache", "PagedKVCache"]
