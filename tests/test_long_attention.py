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


def test_a_spread_batch_matches_sdpa_paged_and_keeps_its_mean():
    assert long_attention.spread_contexts(5, 100, 0.4) == [60, 80, 100, 120, 140]
    assert long_attention.spread_contexts(1, 100, 0.4) == [100]
    torch.manual_seed(5)
    long_attention.check("triton", 1, batch=5, context=100, device=DEVICE, dtype=torch.float32, heads=(4, 2, 32),
                         tolerance=1e-4, spread=0.8)
    inputs = long_attention.step_inputs(3, 2, 40, 64, device="cpu", dtype=torch.float32, heads=(4, 2, 32),
                                        spread=0.5)
    assert inputs["seq_lens"].tolist() == [20, 40, 60] and inputs["block_tables"].shape == (3, 4)
    tables, slots = inputs["block_tables"].long(), inputs["slot_mapping"]
    assert slots.tolist() == [int(tables[r, p // 16]) * 16 + p % 16 for r, c in enumerate((20, 40, 60))
                              for p in (c - 2, c - 1)]
    used = [set(tables[r, :-(-c // 16)].tolist()) for r, c in enumerate((20, 40, 60))]
    assert sorted(set().union(*used)) == list(range(2 + 3 + 4))       # every pool block owned by one request


def test_slots_are_each_requests_last_positions():
    inputs = long_attention.step_inputs(2, 3, 40, 64, device="cpu", dtype=torch.float32, heads=(4, 2, 32))
    tables, slots = inputs["block_tables"].long(), inputs["slot_mapping"]
    expected = [int(tables[r, p // 16]) * 16 + p % 16 for r in range(2) for p in (37, 38, 39)]
    assert slots.tolist() == expected and inputs["query_start_loc"].tolist() == [0, 3, 6]
    assert tables.shape == (2, 4) and (tables[:, 3] == 0).all()


def test_prefill_flops_count_each_querys_causal_keys():
    assert long_attention.prefill_tflops(2, 3, 5) == 4 * 32 * 128 * 2 * (3 + 4 + 5) / 1e12


def test_decode_rows_per_spread_share_the_floor_and_name_the_longest(tmp_path, monkeypatch):
    """main's rows and table with the timing and the check stubbed (they need CUDA graphs): the variant's first use
    (its checks' times), then a row a spread, the same floor (the same KV in total), the longest context in the
    table."""
    monkeypatch.setattr(long_attention, "check", lambda *args, **kwargs: None)
    monkeypatch.setattr(long_attention, "launch_us", lambda *args: 10.0 + 5.0 * args[-1])
    rows = long_attention.main(["--batches", "2", "--contexts", "64", "--spreads", "0", "0.5", "--prefills",
                                "--variants", "triton", "--out", str(tmp_path)])
    first_use, *rows = rows
    assert [(r["spread"], r["longest"], r["us"]) for r in rows] == [(0.0, 64, 10.0), (0.5, 96, 12.5)]
    assert rows[0]["floor_us"] == rows[1]["floor_us"] > 0
    text = (tmp_path / "long_attention.md").read_text()
    assert "| triton | 2 | 64 (96) | 12.5 |" in text
    assert first_use["kind"] == "first_use" and list(first_use["seconds"]) == [k for k, *_ in long_attention.FIRST_USES]
    assert "triton: first use (its check against sdpa_paged, compiling included), seconds: decode " in text
