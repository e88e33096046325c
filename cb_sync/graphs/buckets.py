"""Which batch sizes get a decode graph (buckets), and which plans a graph serves (pure decode)."""

from __future__ import annotations

from bisect import bisect_left


def decode_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, then every 16, always ending at max_batch_size."""
    sizes = [b for b in (1, 2, 4, 8, 16, 24, 32) if b < max_batch_size]
    sizes += range(48, max_batch_size, 16)
    return sorted(set(sizes) | {max_batch_size})


def bucket_for(num_requests: int, buckets: list[int]) -> int:
    """The smallest bucket holding num_requests rows."""
    index = bisect_left(buckets, num_requests)
    if index == len(buckets):
        raise ValueError(f"{num_requests} requests exceed the largest decode bucket {buckets[-1]}")
    return buckets[index]


def is_pure_decode(plan) -> bool:
    """Every scheduled request feeds exactly one token and samples the next: static shapes once padded."""
    return all(chunk.length == 1 and chunk.samples for chunk in plan)
