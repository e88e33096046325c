"""FIFO scheduler: one token budget per step for decodes and prefill chunks; preemption by recompute."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_allocator import BlockAllocator
from .kv_cache import blocks_for
from .request import Request, Status


@dataclass(slots=True)
class ScheduledChunk:
    """request feeds tokens [start, start + length); it samples when that reaches its last token (or goes past it:
    a step planned ahead feeds a token not sampled yet)."""

    request: Request
    start: int
    length: int

    @property
    def samples(self) -> bool:
        return self.start + self.length >= self.request.num_tokens


@dataclass(eq=False)
class Scheduler:
    """Admits requests in arrival order and plans each step within max_batch_tokens and the free KV blocks. Running
    requests are served in the order they were admitted. When blocks run out, the last admitted running request is
    preempted: its blocks are freed and it returns to the head of the queue to be recomputed later (admitted again, it
    is the last admitted: the next to be preempted). Its sampled tokens are kept and sampling is keyed by position, so
    nothing is lost; its recomputed KV is bit-identical to the first only with batch_invariant=True."""

    allocator: BlockAllocator
    block_size: int
    max_batch_tokens: int
    max_batch_size: int
    prefix_sharing: bool = True
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        """The next step's chunks: every running request's next tokens first (decodes, or the rest of a prompt),
        preempting from the last admitted where blocks run out; then waiting requests, in order, while budget, blocks
        and max_batch_size allow, but none in a step that preempted: the blocks it freed are for the running
        requests' next tokens, and the preempted request, now at the head of the queue, would take them back at once."""
        budget = self.max_batch_tokens
        plan: list[ScheduledChunk] = []
        preempted = False
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not Status.RUNNING:      # preempted earlier in this loop
                continue
            length = min(request.num_tokens - request.num_computed, budget)
            while not self._reserve(request, request.num_computed + length):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is Status.RUNNING:
                plan.append(ScheduledChunk(request, request.num_computed, length))
                budget -= length
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_batch_size:
            request = self.waiting[0]
            if self._waits_for_shared_prefix(request):
                break
            self._share_prefix(request)
            length = min(request.num_tokens - request.num_computed, budget)
            if not self._reserve(request, request.num_computed + length):
                self._release(request)
                break
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            plan.append(ScheduledChunk(request, request.num_computed, length))
            budget -= length
        return plan

    def plan_ahead(self, plan: list[ScheduledChunk]) -> list[ScheduledChunk] | None:
        """The pure-decode step after `plan`, a pure-decode step whose tokens are not read yet: the same requests, one
        position on, with their blocks reserved. None where the next schedule() could differ by more than requests
        ending on a stop or EOS token: a request of the plan already finished (computed past its end), one that reaches
        max_new_tokens, a waiting request that could be admitted, or a block not free (no preemption here)."""
        if self.waiting and len(self.running) < self.max_batch_size:
            return None
        if any(c.request.status is Status.FINISHED or len(c.request.output) + 2 > c.request.params.max_new_tokens
               for c in plan):
            return None
        if not all(self._reserve(c.request, c.start + 2) for c in plan):
            return None
        return [ScheduledChunk(c.request, c.start + 1, 1) for c in plan]

    def update(self, plan: list[ScheduledChunk], sampled: list[Request], tokens: list[int],
               logprobs: list[float]) -> list[Request]:
        """After a step: append its tokens, advance the computed counts, free and return the requests that finished
        (those finished before, whose rows a step planned ahead computed past their end, are left out)."""
        plan = [chunk for chunk in plan if chunk.request.status is not Status.FINISHED]
        for request, token, logprob in zip(sampled, tokens, logprobs):
            if request.status is not Status.FINISHED:
                request.append(token, logprob)
        finished = []
        for chunk in plan:
            request = chunk.request
            before = request.num_computed
            request.num_computed = chunk.start + chunk.length
            if self.prefix_sharing:
                self._register_full_blocks(request, before)
            if request.status is Status.FINISHED:
                self._release(request)
                self.running.remove(request)
                finished.append(request)
        return finished

    def _reserve(self, request: Request, num_tokens: int) -> bool:
        missing = blocks_for(num_tokens, self.block_size) - len(request.blocks)
        if missing > self.allocator.num_free:
            return False
        request.blocks.extend(self.allocator.allocate() for _ in range(missing))
        return True

    def _release(self, request: Request) -> None:
        for block in request.blocks:
            self.allocator.free(block)
        request.blocks = []
        request.num_computed = 0

    def _preempt(self, request: Request) -> None:
        self._release(request)
        self.running.remove(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _shareable_blocks(self, request: Request) -> list[tuple[int, ...]]:
        """Token contents of the full prompt blocks that may be shared (the last prompt token stays private)."""
        size = self.block_size
        return [tuple(request.prompt[b * size:(b + 1) * size]) for b in range((len(request.prompt) - 1) // size)]

    def _share_prefix(self, request: Request) -> None:
        """Take the computed blocks of the longest matching prefix. A block is keyed by its parent block and its
        own tokens: exact, since a request holding a block also holds every block before it."""
        if not self.prefix_sharing or request.blocks:
            return
        parent = -1
        for tokens in self._shareable_blocks(request):
            block = self.allocator.lookup((parent, tokens))
            if block is None:
                break
            self.allocator.share(block)
            request.blocks.append(block)
            parent = block
        request.num_computed = len(request.blocks) * self.block_size

    def _waits_for_shared_prefix(self, request: Request) -> bool:
        """True when a running request is still computing this request's first prompt block: wait one step
        and share it instead of computing it twice (the G copies of a GRPO prompt)."""
        if not self.prefix_sharing or request.blocks:
            return False
        blocks = self._shareable_blocks(request)
        if not blocks or self.allocator.lookup((-1, blocks[0])) is not None:
            return False
        return any(other.num_computed < self.block_size <= len(other.prompt) - 1
                   and tuple(other.prompt[:self.block_size]) == blocks[0] for other in self.running)

    def _register_full_blocks(self, request: Request, computed_before: int) -> None:
        shareable = self._shareable_blocks(request) if computed_before < len(request.prompt) else []
        full = min(request.num_computed // self.block_size, len(shareable))
        for b in range(computed_before // self.block_size, full):
            parent = request.blocks[b - 1] if b else -1
            self.allocator.register(request.blocks[b], (parent, shareable[b]))
