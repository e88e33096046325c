"""KV block bookkeeping: a free list, reference counts, and an index of computed full blocks by prefix hash."""

from __future__ import annotations

from collections import deque


class BlockAllocator:
    """Hands out block ids; a block returns to the free list when its last reference is dropped.

    A full block whose K/V has been computed can be registered under the hash of the token prefix it ends,
    so a later request with the same prefix shares it instead of recomputing it.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}

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
            raise RuntimeError(f"block {block} freed twice")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            prefix_hash = self._hash_of.pop(block, None)
            if prefix_hash is not None:
                del self._block_of[prefix_hash]
            self._free.append(block)

    def register(self, block: int, prefix_hash: int) -> None:
        """Record that `block` holds the computed K/V ending the prefix with this hash."""
        if prefix_hash not in self._block_of and block not in self._hash_of:
            self._block_of[prefix_hash] = block
            self._hash_of[block] = prefix_hash

    def lookup(self, prefix_hash: int) -> int | None:
        return self._block_of.get(prefix_hash)

    def ref_count(self, block: int) -> int:
        return self._refs[block]
