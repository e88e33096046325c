"""The attention benchmark's inputs and check on the CPU (Triton interpreter, fp32, tiny heads): decode and prefill
steps built as the driver builds them, so the Triton op and sdpa_paged agree on them; its prefill FLOP count."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from benchmarks import long_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("q_len,context", [(1, 150), (1, 17), (24, 70), (40, 40)])
def test_triton_steps_built_by_the_benchmark_match_sdpa_paged(q_len, context):
    torch.manual_seed(q_len + context)
    long_attention.check("triton", q_len, batch=3, context=context, device=DEVICE, dtype=torch.float32,
                         heads=(4, 2, 32), tolerance=1e-4)


def test_slots_are_each_requests_last_positions():
    inputs = long_attention.step_inputs(2, 3, 40, 64, device="cpu", dtype=torch.float32, heads=(4, 2, 32))
    tables, slots = inputs["block_tables"].long(), inputs["slot_mapping"]
    expected = [int(tables[r, p // 16]) * 16 + p % 16 for r in range(2) for p in (37, 38, 39)]
    assert slots.tolist() == expected and inputs["query_start_loc"].tolist() == [0, 3, 6]
    assert tables.shape == (2, 4) and (tables[:, 3] == 0).all()


def test_prefill_flops_count_each_querys_causal_keys():
    assert long_attention.prefill_tflops(2, 3, 5) == 4 * 32 * 128 * 2 * (3 + 4 + 5) / 1e12
