"""KV block bookkeeping: a free list, reference counts, and an index of computed full blocks by prefix key."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class BlockAllocator:
    """Hands out block ids, each back on the free list once its last reference is dropped. A computed full block
    registered under a key naming the token prefix it ends is shared by later requests with that prefix."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._key_of: dict[int, Hashable] = {}
        self._block_of: dict[Hashable, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV blocks")
        block = self._free.popleft()
        self._refs[block] = 1
        return block

    def share(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise RuntimeError(f"block {block} is not allocated")
        self._refs[block] += 1

    def free(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise RuntimeError(f"block {block} is not allocated (freed twice?)")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            key = self._key_of.pop(block, None)
            if key is not None:
                del self._block_of[key]
            self._free.append(block)

    def register(self, block: int, key: Hashable) -> None:
        """Record that `block` holds the computed K/V ending the prefix named by `key`."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def lookup(self, key: Hashable) -> int | None:
        return self._block_of.get(key)

    def ref_count(self, block: int) -> int:
        return self._refs[block]
