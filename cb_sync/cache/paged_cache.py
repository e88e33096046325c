"""Per-layer paged K/V pools, allocated for what a call needs (`sizing.blocks_to_allocate`) and given back by
release().

Each pool is an allocation of its own (views of one allocation would alias the compiled step's inputs). Where the
pools lie is also kept on the device, in a small table at a fixed address (`pool_offsets`) that the Triton decode
kernel reads at run time: decode graphs captured over it stay valid when the pools come back elsewhere after a
release."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class PagedAttentionCache:
    """K and V pools of shape [num_blocks, block_size, num_kv_heads, head_dim], one pair per layer; pool_offsets:
    int64 [num_layers, 2] on the device, each layer's K and V pools as `offsets_to_pools` from its row (stale while
    released)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    num_blocks: int = 0
    k_caches: list[torch.Tensor] = field(default_factory=list)
    v_caches: list[torch.Tensor] = field(default_factory=list)
    pool_offsets: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.pool_offsets = torch.zeros(self.num_layers, 2, dtype=torch.int64, device=self.device)

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
        self.pool_offsets.copy_(offsets_to_pools(self.pool_offsets, self.k_caches, self.v_caches))

    def release(self) -> None:
        """Drop the pools so their memory can serve training."""
        self.k_caches, self.v_caches, self.num_blocks = [], [], 0


def offsets_to_pools(rows: torch.Tensor, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> torch.Tensor:
    """Host int64 [n, 2]: where the n K and V pools lie, each in its dtype's elements from the address of its row of
    `rows` (contiguous int64 [n, 2], the table that will hold them): a kernel given a row adds these to its address.
    Pools and rows are 16-byte aligned, so the offsets are whole elements and keep that alignment."""
    row_bytes = rows.stride(0) * rows.element_size()
    offsets = []
    for i, (k, v) in enumerate(zip(k_caches, v_caches)):
        row = rows.data_ptr() + i * row_bytes
        if (k.data_ptr() - row) % 16 or (v.data_ptr() - row) % 16:
            raise ValueError(f"KV pools and their offset table must be 16-byte aligned (row {i})")
        offsets.append([(k.data_ptr() - row) // k.element_size(), (v.data_ptr() - row) // v.element_size()])
    return torch.tensor(offsets, dtype=torch.int64).view(-1, 2)


PagedKVCache = PagedAttentionCache     # the name it had before
