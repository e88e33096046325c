"""Per-layer paged K/V pools, allocated for what a call needs (`blocks_to_allocate`) and given back by release().

Each pool is an allocation of its own (views of one allocation would alias the compiled step's inputs). Where the
pools lie is also kept on the device, in a small table at a fixed address (`pool_offsets`) that the Triton decode
kernel reads at run time: decode graphs captured over it stay valid when the pools come back elsewhere after a
release."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class PagedKVCache:
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


def attention_heads(text_config) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a model's text config, with HF's defaults where a field is absent."""
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(text_config, "head_dim", None) or text_config.hidden_size // heads


MIN_STEP_HEADROOM_BYTES = 2 * 2**30    # a floor under step_headroom's estimate, for what it does not count: library
                                       # workspaces, autotuning, the allocator's rounding


def step_headroom(text_config, max_batch_tokens: int, max_batch_size: int, element_size: int) -> int:
    """Bytes to leave free for a step's activations and workspaces: the transient tensors of the largest step (per
    token: the MLP's gate, up and product, q/k/v and the attention output, a few hidden-state copies, in the model's
    dtype; per sampled row: float32 logits, probabilities and noise), at least MIN_STEP_HEADROOM_BYTES."""
    hidden = text_config.hidden_size
    heads, kv_heads, head_dim = attention_heads(text_config)
    intermediate = getattr(text_config, "intermediate_size", None) or 4 * hidden
    per_token = (3 * intermediate + (2 * heads + 2 * kv_heads) * head_dim + 4 * hidden) * element_size
    per_row = 3 * text_config.vocab_size * 4
    return max(MIN_STEP_HEADROOM_BYTES, max_batch_tokens * per_token + max_batch_size * per_row)


def device_room(device: torch.device, held_bytes: int, headroom_bytes: int) -> int | None:
    """Bytes KV pools may take on `device` now: its free memory, the whole segments torch's allocator holds unused
    (not the free pieces of segments in use, which a pool cannot take) and `held_bytes` (the pools that a new
    allocation replaces), less `headroom_bytes` for a step (`step_headroom`); None off CUDA, where no limit is
    known."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    pieces = torch.cuda.memory_stats(device).get("inactive_split_bytes.all.current", 0)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) - pieces
    return max(0, free + unused + held_bytes - headroom_bytes)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def blocks_at_once(request_tokens: list[int], block_size: int, max_running: int) -> int:
    """The most blocks the requests can hold at once: the whole sequences of the `max_running` longest."""
    return sum(sorted((blocks_for(n, block_size) for n in request_tokens), reverse=True)[:max_running])


def blocks_to_allocate(request_tokens: list[int], block_size: int, max_running: int, capacity: int) -> int:
    """`blocks_at_once`, at most `capacity` (what max_cache_gib holds) but never fewer than the largest single request
    needs (the caller has validated that one fits)."""
    return max(min(blocks_at_once(request_tokens, block_size, max_running), capacity),
               blocks_for(max(request_tokens), block_size))
