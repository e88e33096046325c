"""Workload L's attention alone: one layer's K/V store + attention of a step, Qwen3-4B's shape (32 query heads, 8 KV
heads, head dim 128, bf16, blocks of 16), block tables as wide as L's decode graphs (16,384 tokens). Microseconds a
launch, from one CUDA graph of `--launches` launches, replayed.

    python -m benchmarks long_attention [--batches 8 32 64] [--contexts 1024 4096 8192 16384] [--variants triton flash]
        [--programs-per-sm 4 ...] [--prefills 16x1024 2x8192] [--out DIR]

Decode steps: the roofline is the batch's K and V read once at the card's copy bandwidth; `step_ms` is 36 layers of
it. Prefill steps (requests x fresh tokens: 16x1024 is L's prompt step at cb_sync's 16,384-token budget, 2x8192 a
preempted request's recompute): causal attention's FLOPs per second. Variants: `triton` (cb_sync's kernels, the
default tuning), `triton_ppsN` for each --programs-per-sm N (split-K aiming at N programs an SM, decode only), `flash`
(flash-attn 4's paged kernels; skipped with its reason where it cannot run). Each is first checked against
sdpa_paged (the exact reference) on a decode and a prefill batch; those checks' seconds are its first use in the
process, compiling included.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.harness import (KV_BYTES_PER_TOKEN, RESULTS, copy_bandwidth, cuda_seconds, exit_code, graph_us,
                                markdown_table, write_results)

OUT = RESULTS / "long_rollouts"
HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 32, 8, 128, 16, 36


def step_inputs(batch: int, q_len: int, context: int, width_tokens: int, device="cuda", dtype=torch.bfloat16,
                heads: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM)) -> dict:
    """Random pools holding every request's context, block tables `width_tokens` wide (zero-padded), the step's
    queries and K/V (q_len a request) with their slots at each request's last q_len positions."""
    num_heads, num_kv_heads, head_dim = heads
    used = -(-context // BLOCK)
    k_cache, v_cache = (torch.randn(batch * used, BLOCK, num_kv_heads, head_dim, dtype=dtype, device=device)
                        for _ in range(2))
    tables = torch.zeros(batch, max(width_tokens // BLOCK, used), dtype=torch.int32, device=device)
    tables[:, :used] = torch.randperm(batch * used, device=device).to(torch.int32).view(batch, used)
    positions = torch.arange(context - q_len, context, device=device).repeat(batch)
    owners = torch.arange(batch, device=device).repeat_interleave(q_len)
    tokens = batch * q_len
    return dict(query=torch.randn(tokens, num_heads, head_dim, dtype=dtype, device=device),
                key=torch.randn(tokens, num_kv_heads, head_dim, dtype=dtype, device=device),
                value=torch.randn(tokens, num_kv_heads, head_dim, dtype=dtype, device=device),
                k_cache=k_cache, v_cache=v_cache,
                slot_mapping=tables.long()[owners, positions // BLOCK] * BLOCK + positions % BLOCK,
                block_tables=tables, seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
                query_start_loc=torch.arange(0, tokens + 1, q_len, dtype=torch.int32, device=device),
                scale=head_dim ** -0.5)


def step_fn(variant: str, inputs: dict):
    """The variant's op on the inputs, as a step of the driver calls it."""
    if variant == "flash":
        from cb_sync.attention import flash_ops
        return lambda: flash_ops.flash_store_and_attend_op(**inputs)
    from cb_sync.attention import triton_ops
    from cb_sync.tuning import AttentionTuning
    tuning = AttentionTuning(**({"decode_programs_per_sm": int(variant[len("triton_pps"):])}
                                if variant.startswith("triton_pps") else {})).ints()
    return lambda: triton_ops.store_and_attend_op(**inputs, tuning=tuning)


def check(variant: str, q_len: int, batch: int = 4, context: int = 3000, device="cuda", dtype=torch.bfloat16,
          heads: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM), tolerance: float = 2e-2) -> None:
    """The variant against sdpa_paged on a random batch: the pools it leaves and its output."""
    from cb_sync.attention import sdpa_paged
    inputs = step_inputs(batch, q_len, context, 4096, device, dtype, heads)
    pools = inputs["k_cache"].clone(), inputs["v_cache"].clone()
    sdpa_paged.store_kv(inputs["key"], inputs["value"], *pools, inputs["slot_mapping"])
    ref = sdpa_paged.paged_attention(inputs["query"], *pools, inputs["block_tables"], inputs["seq_lens"],
                                     inputs["query_start_loc"], q_len, context, inputs["scale"])
    out = step_fn(variant, inputs)()
    assert torch.equal(inputs["k_cache"], pools[0]) and torch.equal(inputs["v_cache"], pools[1])
    torch.testing.assert_close(out.float(), ref.float(), atol=tolerance, rtol=tolerance)


def prefill_tflops(batch: int, q_len: int, context: int) -> float:
    """TFLOP of one layer's causal attention: each query attends the keys up to its own position."""
    return 4 * HEADS * HEAD_DIM * batch * sum(context - q_len + i + 1 for i in range(q_len)) / 1e12


def unavailable(variant: str) -> str | None:
    """Why the variant cannot run here (its check failed, or flash-attn 4 is missing), else None; its first use's
    seconds go to `first_use`."""
    if variant == "flash":
        try:
            from cb_sync.attention import flash_ops
        except ImportError as error:
            return f"this cb_sync has no flash backend: {error!r}"
        reason = flash_ops.unavailable_reason(torch.device("cuda"), torch.bfloat16)
        if reason:
            return reason
    try:
        check(variant, 1)
        check(variant, 300, context=700)
    except Exception as error:
        return f"check against sdpa_paged failed: {error!r}"[:600]
    return None


def launch_us(variant: str, batch: int, q_len: int, context: int, width_tokens: int, launches: int) -> float:
    return graph_us(step_fn(variant, step_inputs(batch, q_len, context, width_tokens)), launches)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    parser.add_argument("--prefills", nargs="*", default=["16x1024", "2x8192"], metavar="REQUESTSxTOKENS")
    parser.add_argument("--variants", nargs="+", default=["triton", "flash"], choices=["triton", "flash"])
    parser.add_argument("--programs-per-sm", type=int, nargs="*", default=[], help="triton_ppsN decode variants")
    parser.add_argument("--width-tokens", type=int, default=16384)
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--name", default="long_attention")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    rows, variants = [], []
    for variant in [*args.variants, *(f"triton_pps{n}" for n in args.programs_per_sm)]:
        outcome = []
        first_use = round(cuda_seconds(lambda: outcome.append(unavailable(variant))), 3)
        reason = outcome[0]
        if reason:
            rows.append({"variant": variant, "error": reason})
        else:
            variants.append(variant)
            rows.append({"kind": "first_use", "variant": variant, "seconds": first_use})
        report(rows, args)
    for batch in args.batches:
        for context in args.contexts:
            floor_us = 1e6 * batch * context * KV_BYTES_PER_TOKEN / LAYERS / copy_bandwidth()
            for variant in variants:
                us = min(launch_us(variant, batch, 1, context, args.width_tokens, args.launches) for _ in range(2))
                rows.append({"kind": "decode", "variant": variant, "batch": batch, "context": context,
                             "us": round(us, 1), "floor_us": round(floor_us, 1), "of_floor": round(floor_us / us, 3),
                             "step_ms": round(LAYERS * us / 1e3, 2)})
                report(rows, args)
    for batch, tokens in (map(int, case.split("x")) for case in args.prefills):
        for variant in (v for v in variants if not v.startswith("triton_pps")):
            us = min(launch_us(variant, batch, tokens, tokens, args.width_tokens, 3) for _ in range(2))
            rows.append({"kind": "prefill", "variant": variant, "batch": batch, "context": tokens, "us": round(us, 1),
                         "tflop_per_s": round(prefill_tflops(batch, tokens, tokens) / us * 1e6, 1),
                         "step_ms": round(LAYERS * us / 1e3, 2)})
            report(rows, args)
    print(report(rows, args))
    return rows


def report(rows: list[dict], args) -> str:
    """The rows so far to <out>/<name>.json|md (after every row: a failure later keeps them); the table."""
    text = markdown_table(["variant", "batch", "context", "us a layer", "floor us", "of floor", "36 layers ms"],
                          [[r["variant"], r["batch"], r["context"], r["us"], r["floor_us"], r["of_floor"],
                            r["step_ms"]] for r in rows if r.get("kind") == "decode"])
    prefill = [r for r in rows if r.get("kind") == "prefill"]
    if prefill:
        text += "\nPrefill steps (fresh prompts):\n\n" + markdown_table(
            ["variant", "requests", "tokens each", "us a layer", "TFLOP/s", "36 layers ms"],
            [[r["variant"], r["batch"], r["context"], r["us"], r["tflop_per_s"], r["step_ms"]] for r in prefill])
    text += "".join(f"\n{r['variant']}: first use (its checks, compiling included) {r['seconds']} s\n"
                    for r in rows if r.get("kind") == "first_use")
    text += "".join(f"\n{r['variant']}: not run: {r['error']}\n" for r in rows if "error" in r)
    write_results(args.name, rows, text, args.out)
    print(rows[-1], flush=True)
    return text


if __name__ == "__main__":
    sys.exit(exit_code(main()))
