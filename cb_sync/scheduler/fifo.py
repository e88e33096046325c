"""The FIFO scheduler: one token budget per step for decodes and prefill chunks; preemption by recompute."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..cache import BlockAllocator, KVManager
from .plan import ScheduledChunk
from .request import Request, Status


@dataclass(eq=False)
class FIFOScheduler:
    """Admits requests in arrival order and plans each step within max_batch_tokens and the free KV blocks. Running
    requests are served in the order they were admitted. When blocks run out, the last admitted running request is
    preempted: its blocks are freed and it returns to the head of the queue to be recomputed later (admitted again, it
    is the last admitted: the next to be preempted). Its sampled tokens are kept and sampling is keyed by position, so
    nothing is lost; its recomputed KV is bit-identical to the first only with batch_invariant=True. Which blocks a
    request holds is the KV manager's (`kv`)."""

    allocator: BlockAllocator
    block_size: int
    max_batch_tokens: int
    max_batch_size: int
    prefix_sharing: bool = True
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    kv: KVManager = field(init=False)

    def __post_init__(self) -> None:
        self.kv = KVManager(self.allocator, self.block_size, self.prefix_sharing)

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
                self.kv.register_full_blocks(request.prompt, request.blocks, before, request.num_computed)
            if request.status is Status.FINISHED:
                self._release(request)
                self.running.remove(request)
                finished.append(request)
        return finished

    def _reserve(self, request: Request, num_tokens: int) -> bool:
        return self.kv.reserve(request.blocks, num_tokens)

    def _release(self, request: Request) -> None:
        self.kv.release(request.blocks)
        request.blocks = []
        request.num_computed = 0

    def _preempt(self, request: Request) -> None:
        self._release(request)
        self.running.remove(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _share_prefix(self, request: Request) -> None:
        """Take the computed blocks of the longest matching prompt prefix (`KVManager.share_prefix`)."""
        if not self.prefix_sharing or request.blocks:
            return
        request.blocks.extend(self.kv.share_prefix(request.prompt))
        request.num_computed = len(request.blocks) * self.block_size

    def _waits_for_shared_prefix(self, request: Request) -> bool:
        """True when a running request is still computing this request's first prompt block: wait one step
        and share it instead of computing it twice (the G copies of a GRPO prompt)."""
        if not self.prefix_sharing or request.blocks:
            return False
        blocks = self.kv.shareable_blocks(request.prompt)
        if not blocks or self.kv.first_block_computed(request.prompt):
            return False
        return any(other.num_computed < self.block_size <= len(other.prompt) - 1
                   and tuple(other.prompt[:self.block_size]) == blocks[0] for other in self.running)


Scheduler = FIFOScheduler     # the name it had before
