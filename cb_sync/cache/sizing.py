"""KV cache sizing arithmetic: blocks a call needs, the model's attention heads, and the memory a step keeps free."""

from __future__ import annotations

import torch


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
