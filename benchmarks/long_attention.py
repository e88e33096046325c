"""Decode attention at reasoning lengths against its roofline: one layer's K/V store + attention of a decode step,
Qwen3-4B's shape (32 query heads, 8 KV heads, head dim 128, bf16, blocks of 16), per batch and context, with the
block tables as wide as Workload L's decode graphs (`--width-tokens`, 16,384: the next power of two of 9,216
tokens' blocks). Microseconds per launch from one CUDA graph of `--launches` launches, replayed; the roofline is the
batch's K and V read once at the card's copy bandwidth (every launch reads the same pools: a batch's KV under the
50 MB L2, batch 8 at 1k, may be served partly from it); `step_ms` is 36 layers of it.

Variants: `triton` (cb_sync's split-K decode kernel, the default tuning), `triton_pps3` / `triton_pps8` /
`triton_pps16` (split-K aiming at 3 / 8 / 16 programs an SM; 3 keeps batch 8, 32 and 64's grids within one wave of
4 programs an SM: 448, 512 and 512 programs), and `flash` (flash-attn 4's paged kernels, one split: it has no split-KV
path on sm90; skipped with its reason where it cannot run). Each is checked against sdpa_paged on a small batch first.

    python -m benchmarks.long_attention [--batches 8 32 64] [--contexts 1024 4096 8192 16384] [--variants ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import COPY_BANDWIDTH, KV_BYTES_PER_TOKEN, RESULTS, graph_us, markdown_table, write_results
from cb_sync.attention import sdpa_paged, triton_ops
from cb_sync.tuning import AttentionTuning

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 32, 8, 128, 16, 36
TUNINGS = {"triton": AttentionTuning(), "triton_pps3": AttentionTuning(decode_programs_per_sm=3),
           "triton_pps8": AttentionTuning(decode_programs_per_sm=8),
           "triton_pps16": AttentionTuning(decode_programs_per_sm=16)}
VARIANTS = (*TUNINGS, "flash")


def decode_inputs(batch: int, context: int, width_tokens: int) -> dict:
    """Random pools holding every request's context, block tables `width_tokens` wide (zero-padded), the step's
    query and K/V with their slots at each request's last position."""
    used = -(-context // BLOCK)
    blocks = batch * used
    k_cache, v_cache = (torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
                        for _ in range(2))
    tables = torch.zeros(batch, max(width_tokens // BLOCK, used), dtype=torch.int32, device="cuda")
    tables[:, :used] = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, used)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    last = seq_lens.long() - 1
    slots = tables.long().gather(1, (last // BLOCK)[:, None])[:, 0] * BLOCK + last % BLOCK
    return dict(query=torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
                key=torch.randn(batch, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
                value=torch.randn(batch, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
                k_cache=k_cache, v_cache=v_cache, slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"), scale=HEAD_DIM ** -0.5)


def step_fn(variant: str, inputs: dict):
    """The variant's op on the inputs, as a decode graph calls it."""
    if variant == "flash":
        from cb_sync.attention import flash_ops
        return lambda: flash_ops.flash_store_and_attend_op(**inputs)
    tuning = TUNINGS[variant].ints()
    return lambda: triton_ops.store_and_attend_op(**inputs, tuning=tuning)


def flash_unavailable() -> str | None:
    try:
        from cb_sync.attention import flash_ops
    except ImportError as error:
        return f"this cb_sync has no flash backend: {error!r}"
    return flash_ops.unavailable_reason(torch.device("cuda"), torch.bfloat16)


def check(variant: str) -> None:
    """The variant against sdpa_paged on a small random batch (long enough to split)."""
    inputs = decode_inputs(4, 3000, 4096)
    pools = inputs["k_cache"].clone(), inputs["v_cache"].clone()
    sdpa_paged.store_kv(inputs["key"], inputs["value"], *pools, inputs["slot_mapping"])
    ref = sdpa_paged.paged_attention(inputs["query"], *pools, inputs["block_tables"], inputs["seq_lens"],
                                     inputs["query_start_loc"], 1, 3000, inputs["scale"])
    torch.testing.assert_close(step_fn(variant, inputs)().float(), ref.float(), atol=2e-2, rtol=2e-2)


def launch_us(variant: str, batch: int, context: int, width_tokens: int, launches: int) -> float:
    return graph_us(step_fn(variant, decode_inputs(batch, context, width_tokens)), launches, 3)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--width-tokens", type=int, default=16384)
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--name", default="long_attention")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows, variants = [], []
    for variant in args.variants:
        reason = flash_unavailable() if variant == "flash" else None
        if reason is None:
            try:
                check(variant)
            except Exception as error:                # a variant that fails its check is reported, not timed
                reason = f"check against sdpa_paged failed: {error!r}"[:600]
        if reason:
            rows.append({"variant": variant, "error": reason})
            print(rows[-1], flush=True)
        else:
            variants.append(variant)
    for batch in args.batches:
        for context in args.contexts:
            floor_us = 1e6 * batch * context * KV_BYTES_PER_TOKEN / LAYERS / COPY_BANDWIDTH
            for variant in variants:
                us = min(launch_us(variant, batch, context, args.width_tokens, args.launches) for _ in range(2))
                rows.append({"variant": variant, "batch": batch, "context": context, "us": round(us, 1),
                             "floor_us": round(floor_us, 1), "of_floor": round(floor_us / us, 3),
                             "step_ms": round(LAYERS * us / 1e3, 2), "width_tokens": args.width_tokens})
                print(rows[-1], flush=True)
    timed = [r for r in rows if "us" in r]
    table = markdown_table(["variant", "batch", "context", "us a layer", "floor us", "of floor", "36 layers ms"],
                           [[r["variant"], r["batch"], r["context"], r["us"], r["floor_us"], r["of_floor"],
                             r["step_ms"]] for r in timed])
    table += "".join(f"\n{r['variant']}: not run: {r['error']}\n" for r in rows if "error" in r)
    write_results(args.name, rows, table, args.out)
    print(table)
    return rows


if __name__ == "__main__":
    main()
