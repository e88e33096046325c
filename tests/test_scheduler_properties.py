"""Property tests: blocks never leak or double-free; every request finishes exactly once, in budget."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from cb_sync.cache import BlockAllocator
from cb_sync.cache.sizing import blocks_for
from cb_sync.config import SamplingParams
from cb_sync.scheduler import FIFOScheduler, Request, Status


@given(st.lists(st.sampled_from(["alloc", "share", "free"]), max_size=60), st.integers(1, 8))
def test_allocator_refcounts(ops, num_blocks):
    allocator = BlockAllocator(num_blocks)
    held: list[int] = []
    for op in ops:
        if op == "alloc" and allocator.num_free:
            held.append(allocator.allocate())
        elif op == "share" and held:
            allocator.share(held[0])
            held.append(held[0])
        elif op == "free" and held:
            allocator.free(held.pop())
        counts = Counter(held)
        assert allocator.num_free == num_blocks - len(counts)
        assert all(allocator.ref_count(b) == n for b, n in counts.items())
    for block in held:
        allocator.free(block)
    assert allocator.num_free == num_blocks


request_specs = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2)), min_size=1,
                         max_size=12)


@settings(max_examples=150, deadline=None)
@given(request_specs, st.integers(2, 16), st.integers(1, 48), st.integers(1, 6), st.booleans(),
       st.integers(0, 10**6))
def test_scheduler_invariants(specs, block_size, budget, max_batch, sharing, salt):
    capacity = max(blocks_for(p + n, block_size) for p, n, _ in specs) + salt % 4
    allocator = BlockAllocator(capacity)
    scheduler = FIFOScheduler(allocator, block_size, budget, max_batch, prefix_sharing=sharing)
    requests = []
    for i, (prompt_len, new, family) in enumerate(specs):
        prompt = [family] * (prompt_len - 1) + [i % 7]           # families share long prefixes
        requests.append(Request(i, prompt, SamplingParams(max_new_tokens=new), seed=i, eos_ids=frozenset()))
        scheduler.add(requests[-1])
    finished = []
    for _ in range(10_000):
        if not scheduler.has_work():
            break
        plan = scheduler.schedule()
        assert plan, "no progress"
        assert sum(c.length for c in plan) <= budget
        assert len(scheduler.running) <= max_batch
        assert len({id(c.request) for c in plan}) == len(plan)
        for chunk in plan:
            request = chunk.request
            assert request.status is Status.RUNNING
            assert chunk.start == request.num_computed and chunk.length > 0
            assert len(request.blocks) >= blocks_for(chunk.start + chunk.length, block_size)
        contents = {}                                        # a block shared by two requests holds the same tokens
        for r in scheduler.running:
            for b, block in enumerate(r.blocks[:r.num_computed // block_size]):
                tokens = tuple(r.token_slice(b * block_size, (b + 1) * block_size))
                assert contents.setdefault(block, (b, tokens)) == (b, tokens)
        held = Counter(b for r in scheduler.running for b in r.blocks)
        assert all(allocator.ref_count(b) == n for b, n in held.items())
        assert allocator.num_free == capacity - len(held)
        sampled = [chunk.request for chunk in plan if chunk.samples]
        finished += scheduler.update(plan, sampled, [7] * len(sampled), [None] * len(sampled))
    assert not scheduler.has_work()
    assert sorted(r.index for r in finished) == list(range(len(specs)))
    assert all(len(r.output) == r.params.max_new_tokens and r.blocks == [] for r in requests)
    assert allocator.num_free == capacity
