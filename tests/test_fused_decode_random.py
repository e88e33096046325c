"""The fused decode kernel (K/V store + split-K partials + combine by the last partition to arrive) against
sdpa_paged.store_kv + sdpa_paged.paged_attention over random shapes; under the interpreter also with the grid's
programs run in a random order, as a GPU may (the storing partition first or last, the combine in any partition)."""

import itertools
import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from cb_sync import CBConfig, SamplingParams, SyncCBDriver  # noqa: E402
from cb_sync.attention import sdpa_paged, triton_kernels  # noqa: E402
from cb_sync.tuning import AttentionTuning, KernelTuning  # noqa: E402

from conftest import make_model, random_prompts  # noqa: E402
from test_triton_kernels import make_batch, reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS = [(1, 1), (2, 2), (4, 1), (8, 2), (8, 1), (6, 2), (3, 1), (10, 2), (12, 4), (5, 5), (7, 1), (16, 2), (16, 1),
         (24, 1), (40, 2)]
CASES = int(os.environ.get("FUZZ_CASES", "24"))   # random shapes per test (more: FUZZ_CASES=N)
SEEDS = [seed if seed < 4 else pytest.param(seed, marks=pytest.mark.slow) for seed in range(CASES)]
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="reorders the interpreter's programs")


def counters_zero() -> bool:
    return all(bool((b == 0).all()) for bufs in triton_kernels._ARRIVALS.values() for b in bufs)


def random_case(rng: random.Random) -> dict:
    num_heads, num_kv_heads = rng.choice(HEADS)
    block_size = rng.choice([1, 2, 4, 8, 16, 32])
    partition_size = rng.choice([16, 32, 64])
    width = rng.randint(1, 12) * max(1, 32 // block_size)       # block-table width: the kernel's max context
    max_context = width * block_size
    special = [0, 1, max_context, max_context - 1, partition_size - 1, partition_size, partition_size + 1,
               2 * partition_size, 2 * partition_size + 1]
    seq_lens = [min(rng.choice([rng.randint(0, max_context), rng.choice(special)]), max_context)
                for _ in range(rng.randint(1, 7))]
    return dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=rng.choice([8, 16, 24, 32, 40, 64, 80, 128]),
                block_size=block_size, width=width, seq_lens=seq_lens, partition_size=partition_size,
                block_n=rng.choice([16, 32, 64]), window=rng.choice([None, None, 1, 2, 7, 16, 33, 100]),
                softcap=rng.choice([None, None, 0.5, 3.0, 30.0]), skip=[rng.random() < 0.2 for _ in seq_lens])


def run_case(seed: int) -> None:
    case = random_case(random.Random(seed))
    tuning = AttentionTuning(partition_size=case["partition_size"], decode_block_n=case["block_n"])
    gen = torch.Generator().manual_seed(seed)
    bs, width, seq_lens = case["block_size"], case["width"], case["seq_lens"]
    hq, hkv, d, num_reqs = case["num_heads"], case["num_kv_heads"], case["head_dim"], len(seq_lens)
    num_blocks = num_reqs * width + 3
    tables = torch.randperm(num_blocks, generator=gen)[:num_reqs * width].view(num_reqs, width).to(torch.int32)
    for r, s in enumerate(seq_lens):                        # entries past a context: -1 or other blocks
        if torch.rand(1, generator=gen) < 0.5:
            tables[r, -(-s // bs):] = -1
    caches = [torch.randn(num_blocks, bs, hkv, d, generator=gen) for _ in range(2)]
    query = torch.randn(1, hq, num_reqs, d, generator=gen)[0].transpose(0, 1)     # non-contiguous, as handed over
    key = torch.randn(1, hkv, num_reqs, d, generator=gen)[0].transpose(0, 1)
    value = torch.randn(1, hkv, num_reqs, d, generator=gen)[0].transpose(0, 1)
    slots = torch.tensor([int(tables[r, (s - 1) // bs]) * bs + (s - 1) % bs if s > 0 and not case["skip"][r] else -1
                          for r, s in enumerate(seq_lens)])
    lens, starts = torch.tensor(seq_lens, dtype=torch.int32), torch.arange(num_reqs + 1, dtype=torch.int32)
    caches, tables, slots, lens, starts, query, key, value = (
        t.to(DEVICE) if isinstance(t, torch.Tensor) else [c.to(DEVICE) for c in t]
        for t in (caches, tables, slots, lens, starts, query, key, value))
    ref_caches = [c.clone() for c in caches]
    sdpa_paged.store_kv(key, value, *ref_caches, slots)
    ref = sdpa_paged.paged_attention(query, *ref_caches, tables.clamp(min=0), lens, starts, 1, max(seq_lens),
                                     d ** -0.5, case["window"], case["softcap"])
    for _ in range(2):                       # twice: the first launch must leave its arrival counters at zero
        out_caches = [c.clone() for c in caches]
        out = triton_kernels.paged_attention(query, *out_caches, tables, lens, starts, d ** -0.5, case["window"],
                                             case["softcap"], new_kv=(key, value, slots), tuning=tuning)
        assert counters_zero(), case
        assert torch.equal(out_caches[0], ref_caches[0]) and torch.equal(out_caches[1], ref_caches[1]), case
        torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4, msg=lambda m: f"{case}\n{m}")
        assert all((out[r] == 0).all() for r, s in enumerate(seq_lens) if s == 0), case


@pytest.fixture
def shuffled_programs(monkeypatch):
    """The interpreter runs a launch's programs in a random order (it otherwise runs partition 0 of every request
    first, so the storing, last partition always arrives last)."""
    from triton.runtime import interpreter
    builder = interpreter.interpreter_builder
    set_dim, set_idx, state = builder.set_grid_dim, builder.set_grid_idx, {}

    def grid_dim(nx, ny, nz):
        order = list(itertools.product(range(nx), range(ny), range(nz)))
        state["order"], state["next"] = random.Random(len(order) * 7919 + nx).sample(order, len(order)), 0
        set_dim(nx, ny, nz)

    def grid_idx(x, y, z):
        state["next"] += 1
        set_idx(*state["order"][state["next"] - 1])

    monkeypatch.setattr(builder, "set_grid_dim", grid_dim)
    monkeypatch.setattr(builder, "set_grid_idx", grid_idx)


@pytest.mark.parametrize("seed", SEEDS)
def test_fused_decode_matches_store_then_attend(seed):
    run_case(seed)


@pytest.mark.slow
@interpreted
@pytest.mark.parametrize("seed", SEEDS)
def test_fused_decode_in_any_program_order(seed, shuffled_programs):
    run_case(10_000 + seed)


@pytest.mark.slow
@interpreted
@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_prefix_shared_requests_decode_in_any_program_order(arch, shuffled_programs):
    """GRPO-style copies sharing prompt blocks, the static decode path (steps launched ahead), contexts over several
    partitions, programs in a random order: a decode slot that another request reads would change the tokens."""
    tuning = KernelTuning(attention=AttentionTuning(partition_size=16, decode_block_n=16))
    model = make_model(arch)
    base = random_prompts([21, 9])
    prompts = [base[0]] * 3 + [base[0][:17] + base[1][:4]] + [base[1]] * 2
    params = [SamplingParams(max_new_tokens=12, do_sample=True, temperature=1.0, seed=s) for s in range(len(prompts))]
    tokens = {}
    for backend in ("sdpa_paged", "triton"):
        driver = SyncCBDriver(model, CBConfig(attn_backend=backend, block_size=4, max_batch_tokens=64,
                                              max_batch_size=8, prefix_sharing=True, tuning=tuning),
                              static_decode=True)
        tokens[backend] = [r.token_ids for r in driver.generate(prompts, params)]
    assert tokens["triton"] == tokens["sdpa_paged"]
    assert counters_zero()


def test_a_context_past_the_block_table_leaves_no_counter_behind(monkeypatch):
    """seq_len past block_tables.shape[1] * block_size (past the last partition): wrong for that call, but the
    arrival counters must come back to zero, or every later launch for that (request, kv head) never combines."""
    monkeypatch.setattr(triton_kernels, "_ARRIVALS", {})      # counters of this test's own (the others' untouched)
    tuning = AttentionTuning(partition_size=16)
    torch.manual_seed(0)
    bad = make_batch([1], [32], 4, 2, head_dim=16, block_size=16, spare_blocks=0)    # 2 partitions of 16
    bad["seq_lens"] = torch.tensor([40], dtype=torch.int32, device=DEVICE)            # claims 3
    triton_kernels.paged_attention(**bad, tuning=tuning)
    assert counters_zero()
    good = make_batch([1], [20], 4, 2, head_dim=16, block_size=16, spare_blocks=0)
    torch.testing.assert_close(triton_kernels.paged_attention(**good, tuning=tuning), reference(good), atol=1e-4,
                               rtol=1e-4)
