"""How many KV blocks a call needs, and how many the memory cap allows."""

from __future__ import annotations


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
