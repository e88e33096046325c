"""Per-layer paged K/V pools, allocated for what a call needs and given back by release()."""

from __future__ import annotations

import torch


class PagedKVCache:
    """K and V pools of shape [num_blocks, block_size, num_kv_heads, head_dim], one pair per layer."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.num_blocks = 0
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []

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
