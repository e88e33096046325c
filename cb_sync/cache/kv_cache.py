"""Per-layer paged K/V pools, allocated for what a call needs (`blocks_to_allocate`) and given back by release().

Each pool is an allocation of its own (views of one allocation would alias the compiled step's inputs). Freed and
requested again in the same order and sizes, they tend to come back at the same addresses from torch's caching
allocator, where graphs captured over them can be replayed again (`DecodeGraphs.keep_if`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class PagedKVCache:
    """K and V pools of shape [num_blocks, block_size, num_kv_heads, head_dim], one pair per layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    num_blocks: int = 0
    k_caches: list[torch.Tensor] = field(default_factory=list)
    v_caches: list[torch.Tensor] = field(default_factory=list)

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """What the pools hold now."""
        return self.num_blocks * self.bytes_per_block

    def ensure(self, num_blocks: int) -> None:
        """Grow the pools to exactly `num_blocks` blocks (moving their storage) unless they hold at least that many."""
        if self.num_blocks >= num_blocks:
            return
        self.release()
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.num_blocks = num_blocks

    def release(self) -> None:
        """Drop the pools so their memory can serve training."""
        self.k_caches, self.v_caches, self.num_blocks = [], [], 0


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def blocks_to_allocate(request_tokens: list[int], block_size: int, capacity: int) -> int:
    """Blocks covering every request's whole sequence at once, at most `capacity` (what max_cache_gib holds) but never
    fewer than the largest single request needs (the caller has validated that one fits)."""
    blocks = [blocks_for(n, block_size) for n in request_tokens]
    return max(min(sum(blocks), capacity), max(blocks))
