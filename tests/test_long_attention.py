"""Workload L's attention benchmark on the CPU (Triton interpreter, fp32, tiny heads): decode and prefill steps built
as the driver builds them, so the Triton op and sdpa_paged agree on them; its prefill FLOP count and its rows."""

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


def test_rows_and_table_with_the_timing_stubbed(tmp_path, monkeypatch):
    """main's rows and table with the check and the timing stubbed (they need CUDA graphs): the variants' first
    uses, a decode row a batch and context against its floor, a prefill row, and a variant that cannot run."""
    monkeypatch.setattr(long_attention, "unavailable", lambda variant: "no flash here" if variant == "flash" else None)
    monkeypatch.setattr(long_attention, "launch_us", lambda *args: 10.0 * args[1])
    rows = long_attention.main(["--batches", "2", "--contexts", "64", "--prefills", "1x8", "--variants", "triton",
                                "flash", "--programs-per-sm", "4", "--out", str(tmp_path)])
    assert [r.get("kind") for r in rows] == ["first_use", None, "first_use", "decode", "decode", "prefill"]
    decode = [r for r in rows if r.get("kind") == "decode"]
    assert [r["variant"] for r in decode] == ["triton", "triton_pps4"] and decode[0]["floor_us"] > 0
    assert rows[-1]["variant"] == "triton" and rows[-1]["tflop_per_s"] > 0      # no prefill for a decode-only variant
    text = (tmp_path / "long_attention.md").read_text()
    assert "| triton | 2 | 64 | 20.0 |" in text and "flash: not run: no flash here" in text
