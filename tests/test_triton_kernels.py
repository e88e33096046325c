"""Triton paged-attention kernels against the sdpa_paged reference.

Without CUDA the kernels run under the Triton interpreter on the CPU (fp32, tiny sizes); with CUDA the same
tests run compiled, plus the `gpu` tests (bf16 at realistic sizes, CUDA-graph capture and replay).
"""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton (conftest.py sets it too, before transformers imports triton).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from cb_sync.attention import sdpa_paged, triton_kernels, triton_ops  # noqa: E402
from cb_sync.cache.paged_cache import offsets_to_pools  # noqa: E402
from cb_sync.tuning import AttentionTuning  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GQA = [(2, 2), (8, 2), (8, 1)]   # (Hq, Hkv): group sizes 1, 4, 8
gpu = pytest.mark.gpu


def make_batch(q_lens, seq_lens, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, spare_blocks=2,
               dtype=torch.float32, device=DEVICE):
    """Random caches, a shuffled block table (-1 past each request's blocks) and a non-contiguous query."""
    num_reqs = len(seq_lens)
    used = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(used) + 3
    block_ids = torch.randperm(num_blocks).tolist()
    block_tables = torch.full((num_reqs, max(used) + spare_blocks), -1, dtype=torch.int32)
    for r, n in enumerate(used):
        block_tables[r, :n] = torch.tensor(block_ids[:n], dtype=torch.int32)
        del block_ids[:n]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(1, num_heads, sum(q_lens), head_dim, dtype=dtype, device=device)[0].transpose(0, 1)
    return dict(query=query, k_cache=torch.randn(cache_shape, dtype=dtype, device=device),
                v_cache=torch.randn(cache_shape, dtype=dtype, device=device),
                block_tables=block_tables.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                query_start_loc=query_start_loc.to(device), scale=head_dim ** -0.5)


def reference(batch, **kwargs):
    """sdpa_paged on the batch, given the host-side bounds it needs (the Triton kernels read none)."""
    q_lens = batch["query_start_loc"].diff()
    return sdpa_paged.paged_attention(**batch, max_query_len=int(q_lens.max()),
                                      max_seq_len=int(batch["seq_lens"].max()), **kwargs)


def check(batch, atol=1e-4, tuning=AttentionTuning(), **kwargs):
    out = triton_kernels.paged_attention(**batch, **kwargs, tuning=tuning)
    ref = reference(batch, **kwargs)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=atol, rtol=atol)
    return out


@pytest.fixture
def small_partitions():
    """A tuning of split-K partitions of 32 tokens, so short test contexts span several."""
    return AttentionTuning(partition_size=32)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16])
def test_store_kv_skips_negative_slots(head_dim, block_size):
    torch.manual_seed(0)
    num_tokens, num_kv_heads, num_blocks = 7, 2, 5
    key = torch.randn(1, num_kv_heads, num_tokens, head_dim, device=DEVICE)[0].transpose(0, 1)
    value = torch.randn(1, num_kv_heads, num_tokens, head_dim, device=DEVICE)[0].transpose(0, 1)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[1, 4]] = -1
    slots = slots.to(DEVICE)
    caches = [torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE) for _ in range(2)]
    expected = [c.clone() for c in caches]
    triton_kernels.store_kv(key, value, *caches, slots)
    sdpa_paged.store_kv(key, value, *expected, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_split_k(heads, head_dim, small_partitions):
    torch.manual_seed(1)
    seq_lens = [150, 1, 0, 37, 97]   # 0: padded row
    batch = make_batch([1] * len(seq_lens), seq_lens, *heads, head_dim)
    out = check(batch, tuning=small_partitions)
    assert (out[2] == 0).all()


@pytest.mark.parametrize("block_n", [16, 64])
def test_decode_splits_each_context_into_the_grids_partitions(block_n):
    """Three partitions at most over tables 1,024 tokens wide: a long context splits into parts wider than the
    smallest (whole key tiles), a short one into fewer parts; contexts at, under and over the tile boundaries."""
    torch.manual_seed(6)
    seq_lens = [1000, 1, 0, 257, 513, 999, 64]
    batch = make_batch([1] * len(seq_lens), seq_lens, 4, 2, head_dim=32, spare_blocks=1)
    tuning = AttentionTuning(partition_size=32, max_partitions=3, decode_block_n=block_n)
    assert triton_kernels.decode_partitions(batch["block_tables"].shape[1] * 16, 14, torch.device(DEVICE), tuning) == 3
    assert (check(batch, tuning=tuning)[2] == 0).all()


def test_decode_default_partition_and_block_size_32():
    torch.manual_seed(2)
    check(make_batch([1, 1, 1], [300, 45, 0], block_size=32, spare_blocks=9))


@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_chunked(heads, head_dim):
    torch.manual_seed(3)
    q_lens = [20, 1, 1, 7, 70]
    seq_lens = [20, 13, 0, 50, 90]   # fresh prompt, decode row, padded row, two chunks after cached context
    out = check(make_batch(q_lens, seq_lens, *heads, head_dim))
    assert (out[21] == 0).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_tiles_of_many_requests_of_mixed_lengths(seed):
    """The prefill grid numbers query tiles across requests (no host-side bound): lengths around multiples of the
    tile, single-token chunks and cached context, in 37 requests (a six-step search for each tile's request)."""
    torch.manual_seed(20 + seed)
    q_lens = torch.randint(1, 40, (37,))
    q_lens[:6] = torch.tensor([16, 15, 17, 1, 32, 33])
    cached = torch.randint(0, 30, (37,)) * (torch.rand(37) < 0.5)
    check(make_batch(q_lens.tolist(), (q_lens + cached).tolist(), 8, 2, head_dim=16, block_size=8))


@pytest.mark.parametrize("block_size", [8, 32])
def test_prefill_block_sizes(block_size):
    torch.manual_seed(4)
    check(make_batch([33, 5], [61, 5], block_size=block_size))


@pytest.mark.parametrize("decode", [True, False])
def test_non_power_of_two_head_dim_and_group(decode, small_partitions):
    torch.manual_seed(9)
    seq_lens = [70, 0, 33]
    q_lens = [1] * 3 if decode else [30, 1, 33]
    check(make_batch(q_lens, seq_lens, num_heads=6, num_kv_heads=2, head_dim=80), tuning=small_partitions)


@pytest.mark.parametrize("sliding_window,softcap", [(16, None), (None, 2.0), (20, 1.5)])
@pytest.mark.parametrize("decode", [True, False])
def test_sliding_window_and_softcap(sliding_window, softcap, decode, small_partitions):
    torch.manual_seed(5)
    seq_lens = [120, 9, 0, 47]
    q_lens = [1] * 4 if decode else [40, 9, 1, 12]
    check(make_batch(q_lens, seq_lens, 8, 2), sliding_window=sliding_window, softcap=softcap,
          tuning=small_partitions)


@pytest.mark.parametrize("fused", [True, False])
def test_store_then_attend_matches_reference(fused, small_partitions):
    """A prompt prefilled in two chunks, then two decode steps, through store_kv + paged_attention, or with the
    step's K/V handed to paged_attention (stored inside the decode kernel)."""
    torch.manual_seed(6)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 8
    steps = [(12, 12), (9, 21), (1, 22), (1, 23)]   # (new tokens, context length after them)
    block_table = torch.randperm(6).to(torch.int32)[None].to(DEVICE)
    caches = [torch.zeros(6, block_size, num_kv_heads, head_dim, device=DEVICE) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    for q_len, seq_len in steps:
        pos = torch.arange(seq_len - q_len, seq_len, device=DEVICE)
        slots = block_table[0, pos // block_size].long() * block_size + pos % block_size
        key, value = (torch.randn(q_len, num_kv_heads, head_dim, device=DEVICE) for _ in range(2))
        query = torch.randn(q_len, num_heads, head_dim, device=DEVICE)
        meta = (block_table, torch.tensor([seq_len], dtype=torch.int32, device=DEVICE),
                torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE))
        if not fused:
            triton_kernels.store_kv(key, value, *caches, slots)
        sdpa_paged.store_kv(key, value, *ref_caches, slots)
        out = triton_kernels.paged_attention(query, *caches, *meta, head_dim ** -0.5,
                                             new_kv=(key, value, slots) if fused else None, tuning=small_partitions)
        ref = sdpa_paged.paged_attention(query, *ref_caches, *meta, q_len, seq_len, head_dim ** -0.5)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])


@pytest.mark.parametrize("heads", GQA)
def test_decode_stores_each_request_kv_then_attends(heads, small_partitions):
    """Decode with the step's K/V stored by the kernel: each request's new key at its own next position (a padded
    row and a skipped slot store nothing), contexts over one to five partitions; run twice, so the arrival counters
    must have been left at zero by the first launch."""
    torch.manual_seed(13)
    seq_lens = [150, 1, 0, 33, 97, 64]
    batch = make_batch([1] * len(seq_lens), seq_lens, *heads, 64)
    num_kv_heads = heads[1]
    tables, block_size = batch["block_tables"].long(), batch["k_cache"].shape[1]
    positions = (torch.tensor(seq_lens, device=DEVICE) - 1).clamp(min=0)
    slots = tables.gather(1, (positions // block_size)[:, None])[:, 0] * block_size + positions % block_size
    slots[[2, 4]] = -1                                              # the padded row; a row that keeps its cache
    key, value = (torch.randn(len(seq_lens), num_kv_heads, 64, device=DEVICE) for _ in range(2))
    ref_caches = [batch["k_cache"].clone(), batch["v_cache"].clone()]
    sdpa_paged.store_kv(key, value, *ref_caches, slots)
    ref = reference({**batch, "k_cache": ref_caches[0], "v_cache": ref_caches[1]})
    for _ in range(2):
        out = triton_kernels.paged_attention(**batch, new_kv=(key, value, slots), tuning=small_partitions)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        assert torch.equal(batch["k_cache"], ref_caches[0]) and torch.equal(batch["v_cache"], ref_caches[1])
    assert (out[2] == 0).all()


def test_decode_reads_and_stores_through_the_pool_offsets(small_partitions):
    """Given pool_offsets, the decode kernel stores into and attends over the pools they point at, not the k_cache /
    v_cache arguments (which only give the type): a captured step follows pools allocated elsewhere."""
    torch.manual_seed(14)
    seq_lens = [70, 1, 0, 33]
    batch = make_batch([1] * len(seq_lens), seq_lens, 8, 2, 64)
    tables, block_size = batch["block_tables"].long(), batch["k_cache"].shape[1]
    positions = (torch.tensor(seq_lens, device=DEVICE) - 1).clamp(min=0)
    slots = tables.gather(1, (positions // block_size)[:, None])[:, 0] * block_size + positions % block_size
    slots[2] = -1
    key, value = (torch.randn(len(seq_lens), 2, 64, device=DEVICE) for _ in range(2))
    pools = batch["k_cache"].clone(), batch["v_cache"].clone()
    offsets = torch.zeros(1, 2, dtype=torch.int64, device=DEVICE)
    offsets.copy_(offsets_to_pools(offsets, [pools[0]], [pools[1]]))
    stale = [torch.zeros_like(pools[0]), torch.zeros_like(pools[1])]
    sdpa_paged.store_kv(key, value, batch["k_cache"], batch["v_cache"], slots)
    ref = reference(batch)
    out = triton_kernels.paged_attention(**{**batch, "k_cache": stale[0], "v_cache": stale[1]},
                                         new_kv=(key, value, slots), tuning=small_partitions, pool_offsets=offsets[0])
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(pools[0], batch["k_cache"]) and torch.equal(pools[1], batch["v_cache"])
    assert not stale[0].any() and not stale[1].any()


def test_arrival_counters_are_not_allocated_during_graph_capture(monkeypatch):
    """A capture would record the counters' zeroing instead of running it: a clear error instead."""
    monkeypatch.setattr(triton_kernels, "_ARRIVALS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before CUDA-graph capture"):
        triton_kernels._arrival_counters(torch.device("cuda", 0), 8)


def test_custom_op_matches_and_fake_shapes():
    torch.manual_seed(7)
    batch = make_batch([3, 1], [10, 4])
    key, value = (torch.randn(4, 2, 64, device=DEVICE) for _ in range(2))
    slots = torch.tensor([3, -1, 17, 0], device=DEVICE)
    expected = triton_kernels.paged_attention(**{**batch, "k_cache": batch["k_cache"].clone(),
                                                 "v_cache": batch["v_cache"].clone()}, new_kv=(key, value, slots))
    args = (batch["query"], key, value, batch["k_cache"].clone(), batch["v_cache"].clone(), slots,
            batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], batch["scale"])
    torch.testing.assert_close(torch.ops.cb_sync.store_and_attend(*args), expected, atol=0, rtol=0)
    sdpa_paged.store_kv(key, value, batch["k_cache"], batch["v_cache"], slots)
    assert torch.equal(args[3], batch["k_cache"]) and torch.equal(args[4], batch["v_cache"])

    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        out = torch.ops.cb_sync.store_and_attend(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                   for a in args], sliding_window=4, softcap=3.0)
    assert out.shape == batch["query"].shape and out.dtype == batch["query"].dtype and out.is_contiguous()


def test_opcheck():
    torch.manual_seed(8)
    batch = make_batch([2, 1], [5, 3], 4, 2, head_dim=16, block_size=8)
    key, value = (torch.randn(3, 2, 16, device=DEVICE) for _ in range(2))
    slots = torch.tensor([1, -1, 9], device=DEVICE)
    torch.library.opcheck(triton_ops.store_and_attend_op, (
        batch["query"], key, value, batch["k_cache"], batch["v_cache"], slots, batch["block_tables"],
        batch["seq_lens"], batch["query_start_loc"], batch["scale"]))


def rel_error(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def reference_fp32(batch, **kwargs):
    return reference({k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                      for k, v in batch.items()}, **kwargs)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_reqs", [1, 7, 32, 128])
def test_gpu_decode_bf16(num_reqs):
    torch.manual_seed(10)
    seq_lens = torch.randint(1, 2000, (num_reqs,)).tolist()
    if num_reqs > 1:
        seq_lens[-1] = 0
    batch = make_batch([1] * num_reqs, seq_lens, 32, 8, 128, dtype=torch.bfloat16, spare_blocks=20)
    for kwargs in ({}, dict(sliding_window=512, softcap=30.0)):
        out = triton_kernels.paged_attention(**batch, **kwargs)
        assert rel_error(out, reference_fp32(batch, **kwargs)) < 1e-2
        assert not out.isnan().any() and (num_reqs == 1 or (out[-1] == 0).all())


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_prefill_bf16():
    torch.manual_seed(11)
    q_lens = [128] * 6 + [1, 1, 64]
    seq_lens = [128] * 6 + [700, 0, 1500]   # fresh prompts, a decode row, a padded row, a chunk after 1436 cached
    batch = make_batch(q_lens, seq_lens, 32, 8, 128, dtype=torch.bfloat16)
    for kwargs in ({}, dict(sliding_window=100, softcap=30.0)):
        out = triton_kernels.paged_attention(**batch, **kwargs)
        assert rel_error(out, reference_fp32(batch, **kwargs)) < 1e-2
        assert not out.isnan().any() and (out[6 * 128 + 1] == 0).all()


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_decode_cuda_graph_replay():
    """The op (K/V store + decode in one kernel) captured once, replayed after seq_lens / block_tables / inputs /
    slots change in place: outputs and caches equal to running it directly."""
    torch.manual_seed(12)
    num_reqs, max_blocks = 16, 128
    batch = make_batch([1] * num_reqs, torch.randint(1, 1000, (num_reqs,)).tolist(), 32, 8, 128,
                       dtype=torch.bfloat16, spare_blocks=max_blocks)
    batch["block_tables"] = batch["block_tables"][:, :max_blocks].contiguous()
    num_blocks = batch["k_cache"].shape[0]
    for name in ("k_cache", "v_cache"):      # one block per request past the tables' blocks, for its slots
        batch[name] = torch.cat([batch[name], torch.randn_like(batch[name][:num_reqs])])
    key, value = (torch.randn(num_reqs, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    slots = torch.full((num_reqs,), -1, dtype=torch.long, device="cuda")

    def step():
        return triton_ops.store_and_attend_op(batch["query"], key, value, batch["k_cache"], batch["v_cache"], slots,
                                              batch["block_tables"], batch["seq_lens"], batch["query_start_loc"],
                                              batch["scale"])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()   # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    for trial in range(3):
        seq_lens = torch.randint(1, max_blocks * 16, (num_reqs,))
        seq_lens[trial] = 0
        batch["seq_lens"].copy_(seq_lens)
        batch["block_tables"].copy_(torch.randint(0, num_blocks, (num_reqs, max_blocks)))
        batch["query"].copy_(torch.randn_like(batch["query"]))
        key.copy_(torch.randn_like(key))
        value.copy_(torch.randn_like(value))
        slots.copy_((num_blocks + torch.arange(num_reqs, device="cuda")) * 16 + torch.randint(0, 16, (num_reqs,),
                                                                                              device="cuda"))
        slots[trial] = -1
        caches = batch["k_cache"].clone(), batch["v_cache"].clone()
        graph.replay()
        graphed = static_out.clone(), batch["k_cache"].clone(), batch["v_cache"].clone()
        batch["k_cache"].copy_(caches[0])
        batch["v_cache"].copy_(caches[1])
        direct = step(), batch["k_cache"], batch["v_cache"]
        for a, b in zip(graphed, direct):
            assert torch.equal(a, b)
        assert (graphed[0][trial] == 0).all()


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_decode_graph_follows_pools_to_new_addresses():
    """A decode step captured over pools reached through their offset table, replayed after the pools were copied to
    new allocations and the table rewritten: it stores into and reads the new pools, bit for bit as a direct call on
    them, and leaves the old ones as they were."""
    torch.manual_seed(15)
    num_reqs = 8
    batch = make_batch([1] * num_reqs, torch.randint(2, 600, (num_reqs,)).tolist(), 32, 8, 128, dtype=torch.bfloat16)
    tables, block_size = batch["block_tables"].long(), batch["k_cache"].shape[1]
    positions = batch["seq_lens"].long() - 1
    slots = tables.gather(1, (positions // block_size)[:, None])[:, 0] * block_size + positions % block_size
    key, value = (torch.randn(num_reqs, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    pools = [batch["k_cache"], batch["v_cache"]]
    table = torch.zeros(1, 2, dtype=torch.int64, device="cuda")
    table.copy_(offsets_to_pools(table, *([p] for p in pools)))

    def step(k_cache, v_cache, offsets):
        return triton_ops.store_and_attend_op(batch["query"], key, value, k_cache, v_cache, slots,
                                              batch["block_tables"], batch["seq_lens"], batch["query_start_loc"],
                                              batch["scale"], pool_offsets=offsets)

    step(*pools, table[0])                                  # compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(*pools, table[0])
    moved = [p.clone() + 1 for p in pools]                  # new contents at new addresses
    before_old = [p.clone() for p in pools]
    direct_pools = [p.clone() for p in moved]
    table.copy_(offsets_to_pools(table, *([p] for p in moved)))
    graph.replay()
    direct = step(*direct_pools, None)
    assert torch.equal(static_out, direct)
    assert torch.equal(moved[0], direct_pools[0]) and torch.equal(moved[1], direct_pools[1])
    assert torch.equal(pools[0], before_old[0]) and torch.equal(pools[1], before_old[1])
