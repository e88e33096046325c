"""Which KV blocks each request holds: reserving them for the tokens a step feeds, releasing them, sharing the
computed blocks of a prompt prefix, and registering full prompt blocks once computed so that later prompts share them.
A request's blocks are a list of block ids it owns, extended here."""

from __future__ import annotations

from .block_allocator import BlockAllocator
from .sizing import blocks_for


class KVManager:
    """Block lists over one allocator. A full prompt block is keyed by its parent block and its own tokens: exact,
    since a holder of a block also holds every block before it. The last prompt token's block stays private (its
    K/V is fed again to sample the first output)."""

    def __init__(self, allocator: BlockAllocator, block_size: int, prefix_sharing: bool = True):
        self.allocator = allocator
        self.block_size = block_size
        self.prefix_sharing = prefix_sharing

    def reserve(self, blocks: list[int], num_tokens: int) -> bool:
        """Extend `blocks` to hold `num_tokens` tokens; False (nothing taken) where too few blocks are free."""
        missing = blocks_for(num_tokens, self.block_size) - len(blocks)
        if missing > self.allocator.num_free:
            return False
        blocks.extend(self.allocator.allocate() for _ in range(missing))
        return True

    def release(self, blocks: list[int]) -> None:
        """Drop a reference to each of `blocks` (the holder then drops the list)."""
        for block in blocks:
            self.allocator.free(block)

    def shareable_blocks(self, prompt: list[int]) -> list[tuple[int, ...]]:
        """Token contents of the full prompt blocks that may be shared (the last prompt token stays private)."""
        size = self.block_size
        return [tuple(prompt[b * size:(b + 1) * size]) for b in range((len(prompt) - 1) // size)]

    def first_block_computed(self, prompt: list[int]) -> bool:
        """Whether the prompt's first shareable block is computed and registered (False where it has none)."""
        blocks = self.shareable_blocks(prompt)
        return bool(blocks) and self.allocator.lookup((-1, blocks[0])) is not None

    def share_prefix(self, prompt: list[int]) -> list[int]:
        """The computed blocks of the prompt's longest registered prefix, each with a reference taken."""
        shared, parent = [], -1
        for tokens in self.shareable_blocks(prompt):
            block = self.allocator.lookup((parent, tokens))
            if block is None:
                break
            self.allocator.share(block)
            shared.append(block)
            parent = block
        return shared

    def register_full_blocks(self, prompt: list[int], blocks: list[int], computed_before: int,
                             computed: int) -> None:
        """Register the prompt blocks that became full and computed as the computed tokens went from
        `computed_before` to `computed`."""
        shareable = self.shareable_blocks(prompt) if computed_before < len(prompt) else []
        full = min(computed // self.block_size, len(shareable))
        for b in range(computed_before // self.block_size, full):
            parent = blocks[b - 1] if b else -1
            self.allocator.register(blocks[b], (parent, shareable[b]))
