"""Per-layer paged K/V pools, allocated for what a call needs (`blocks_to_allocate`) and given back by release()."""

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
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def ensure(self, num_blocks: int) -> bool:
        """Make the pools hold exactly `num_blocks` blocks unless they already hold at least that many.

        Returns True when the pools were (re)allocated, which moves their storage.
        """
        if self.num_blocks >= num_blocks:
            return False
        self.release()
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.num_blocks = num_blocks
        return True

    def release(self) -> None:
        """Drop the pools so their memory can serve training."""
        self.k_caches, self.v_caches, self.num_blocks = [], [], 0


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def blocks_to_allocate(request_tokens: list[int], block_size: int, bytes_per_block: int,
                       max_cache_gib: float) -> int:
    """Blocks covering every request's whole sequence at once, capped by max_cache_gib.

    The cap never goes below the largest single request (the caller has validated that one fits).
    """
    needed = sum(blocks_for(n, block_size) for n in request_tokens)
    cap = int(max_cache_gib * 2**30) // bytes_per_block
    largest = max(blocks_for(n, block_size) for n in request_tokens)
    return max(min(needed, cap), largest)
