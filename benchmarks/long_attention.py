"""Attention at reasoning lengths: one layer's K/V store + attention of a step, Qwen3-4B's shape (32 query heads,
8 KV heads, head dim 128, bf16, blocks of 16), with the block tables as wide as Workload L's decode graphs
(`--width-tokens`, 16,384: the next power of two of 9,216 tokens' blocks). Microseconds per launch from one CUDA
graph of `--launches` launches, replayed. `--spreads` gives a decode batch's requests different contexts around the
same mean (0.4: from 0.6x to 1.4x the context, evenly spaced), as a continuous batch after preemptions or admissions
holds them: the floor is unchanged (the same KV in total), the time shows what the longest request costs.

Decode steps, per batch and context: the roofline is the batch's K and V read once at the card's copy bandwidth
(every launch reads the same pools: a batch's KV under the 50 MB L2, batch 8 at 1k, may be served partly from it);
`step_ms` is 36 layers of it. Prefill steps (`--prefills`, requests x fresh tokens: 16x1024 is Workload L's prompt
step at cb_sync's 16,384-token budget, 2x8192 a preempted request's recompute): causal attention's FLOPs (4 x heads x
head dim a query-key pair) per second; which backend is faster there decides what `auto` may pick for prefill.

Variants: `triton` (cb_sync's kernels, the default tuning), `triton_pps3` / `triton_pps8` / `triton_pps16` (split-K
aiming at 3 / 8 / 16 programs an SM, decode only; 3 keeps batch 8, 32 and 64's grids within one wave of 4 programs
an SM: 448, 512 and 512 programs), and `flash` (flash-attn 4's paged kernels, one split in decode: it has no split-KV
path on sm90; skipped with its reason where it cannot run). Each is checked against sdpa_paged on a small decode
batch, one of spread contexts and a small prefill batch first; those checks are timed, the first use of its kernels
in the process (their compile included, unless a disk cache holds them: flash-attn 4 compiles at first use).

    python -m benchmarks.long_attention [--batches 8 32 64] [--contexts 1024 4096 8192 16384] [--variants ...]
        [--prefills 16x1024 2x8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.common import (KV_BYTES_PER_TOKEN, RESULTS, copy_bandwidth, cuda_seconds, exit_code, graph_us,
                               markdown_table, write_results)
from cb_sync.attention import sdpa_paged, triton_ops
from cb_sync.tuning import AttentionTuning

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 32, 8, 128, 16, 36
TUNINGS = {"triton": AttentionTuning(), "triton_pps3": AttentionTuning(decode_programs_per_sm=3),
           "triton_pps8": AttentionTuning(decode_programs_per_sm=8),
           "triton_pps16": AttentionTuning(decode_programs_per_sm=16)}
VARIANTS = (*TUNINGS, "flash")
DECODE_ONLY = ("triton_pps3", "triton_pps8", "triton_pps16")


def spread_contexts(batch: int, context: int, spread: float) -> list[int]:
    """Each request's context: evenly spaced from (1 - spread) to (1 + spread) x context, their mean `context`."""
    if batch == 1 or not spread:
        return [context] * batch
    return [round(context * (1 + spread * (2 * i / (batch - 1) - 1))) for i in range(batch)]


def step_inputs(batch: int, q_len: int, context: int, width_tokens: int, device="cuda", dtype=torch.bfloat16,
                heads: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM), spread: float = 0.0) -> dict:
    """Random pools holding every request's context (`spread_contexts`), block tables `width_tokens` wide
    (zero-padded), the step's queries and K/V (q_len a request) with their slots at each request's last q_len
    positions; heads: (query heads, KV heads, head dim)."""
    num_heads, num_kv_heads, head_dim = heads
    contexts = spread_contexts(batch, context, spread)
    used = [-(-c // BLOCK) for c in contexts]
    blocks = sum(used)
    k_cache, v_cache = (torch.randn(blocks, BLOCK, num_kv_heads, head_dim, dtype=dtype, device=device)
                        for _ in range(2))
    tables = torch.zeros(batch, max(width_tokens // BLOCK, *used), dtype=torch.int32, device=device)
    shuffled = torch.randperm(blocks, device=device).to(torch.int32).split(used)
    for row, ids in enumerate(shuffled):
        tables[row, :len(ids)] = ids
    positions = torch.cat([torch.arange(c - q_len, c, device=device) for c in contexts])
    owners = torch.arange(batch, device=device).repeat_interleave(q_len)
    slots = tables.long()[owners, positions // BLOCK] * BLOCK + positions % BLOCK
    tokens = batch * q_len
    return dict(query=torch.randn(tokens, num_heads, head_dim, dtype=dtype, device=device),
                key=torch.randn(tokens, num_kv_heads, head_dim, dtype=dtype, device=device),
                value=torch.randn(tokens, num_kv_heads, head_dim, dtype=dtype, device=device),
                k_cache=k_cache, v_cache=v_cache, slot_mapping=slots, block_tables=tables,
                seq_lens=torch.tensor(contexts, dtype=torch.int32, device=device),
                query_start_loc=torch.arange(0, tokens + 1, q_len, dtype=torch.int32, device=device),
                scale=head_dim ** -0.5)


def step_fn(variant: str, inputs: dict):
    """The variant's op on the inputs, as a step of the driver calls it."""
    if variant == "flash":
        from cb_sync.attention import flash_ops
        return lambda: flash_ops.flash_store_and_attend_op(**inputs)
    tuning = TUNINGS[variant].ints()
    return lambda: triton_ops.store_and_attend_op(**inputs, tuning=tuning)


# the checks each variant runs first, in this order: (kind, query tokens a request, context, spread); their times are
# the first use of its kernels in the process, compiling them included (unless a disk cache holds them)
FIRST_USES = (("decode", 1, 3000, 0.0), ("decode, spread contexts", 1, 3000, 0.5), ("prefill", 300, 700, 0.0))


def check(variant: str, q_len: int, batch: int = 4, context: int = 3000, device="cuda", dtype=torch.bfloat16,
          heads: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM), tolerance: float = 2e-2,
          spread: float = 0.0) -> None:
    """The variant against sdpa_paged on a random batch (a decode batch long enough to split, or a prefill chunk
    after cached context; `spread`: contexts of different lengths): the pools it leaves and its output."""
    inputs = step_inputs(batch, q_len, context, 4096, device, dtype, heads, spread)
    pools = inputs["k_cache"].clone(), inputs["v_cache"].clone()
    sdpa_paged.store_kv(inputs["key"], inputs["value"], *pools, inputs["slot_mapping"])
    ref = sdpa_paged.paged_attention(inputs["query"], *pools, inputs["block_tables"], inputs["seq_lens"],
                                     inputs["query_start_loc"], q_len, int(inputs["seq_lens"].max()),
                                     inputs["scale"])
    out = step_fn(variant, inputs)()
    assert torch.equal(inputs["k_cache"], pools[0]) and torch.equal(inputs["v_cache"], pools[1])
    torch.testing.assert_close(out.float(), ref.float(), atol=tolerance, rtol=tolerance)


def prefill_tflops(batch: int, q_len: int, context: int) -> float:
    """TFLOP of one layer's causal attention: each query attends the keys up to its own position."""
    pairs = batch * sum(context - q_len + i + 1 for i in range(q_len))
    return 4 * HEADS * HEAD_DIM * pairs / 1e12


def flash_unavailable() -> str | None:
    try:
        from cb_sync.attention import flash_ops
    except ImportError as error:
        return f"this cb_sync has no flash backend: {error!r}"
    return flash_ops.unavailable_reason(torch.device("cuda"), torch.bfloat16)


def launch_us(variant: str, batch: int, q_len: int, context: int, width_tokens: int, launches: int,
              spread: float = 0.0) -> float:
    return graph_us(step_fn(variant, step_inputs(batch, q_len, context, width_tokens, spread=spread)), launches, 3)


def _prefill_case(text: str) -> tuple[int, int]:
    requests, tokens = text.split("x")
    return int(requests), int(tokens)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    parser.add_argument("--prefills", type=_prefill_case, nargs="*", default=[(16, 1024), (2, 8192)],
                        metavar="REQUESTSxTOKENS", help="prefill steps of fresh prompts (none: decode only)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--spreads", type=float, nargs="+", default=[0.0],
                        help="decode contexts spread around each context (0.4: 0.6x to 1.4x), a row each")
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
                first_use = {kind: round(cuda_seconds(lambda: check(variant, q_len, context=context, spread=spread)), 3)
                             for kind, q_len, context, spread in FIRST_USES}
                rows.append({"kind": "first_use", "variant": variant, "seconds": first_use})
            except Exception as error:                # a variant that fails its check is reported, not timed
                reason = f"check against sdpa_paged failed: {error!r}"[:600]
        if reason:
            rows.append({"variant": variant, "error": reason})
            print(rows[-1], flush=True)
            report(rows, args)
        else:
            variants.append(variant)
    for batch, context, spread in ((b, c, s) for b in args.batches for c in args.contexts for s in args.spreads):
        contexts = spread_contexts(batch, context, spread)
        floor_us = 1e6 * sum(contexts) * KV_BYTES_PER_TOKEN / LAYERS / copy_bandwidth()
        for variant in variants:
            us = min(launch_us(variant, batch, 1, context, args.width_tokens, args.launches, spread)
                     for _ in range(2))
            rows.append({"kind": "decode", "variant": variant, "batch": batch, "context": context, "spread": spread,
                         "longest": max(contexts), "us": round(us, 1),
                         "floor_us": round(floor_us, 1), "of_floor": round(floor_us / us, 3),
                         "step_ms": round(LAYERS * us / 1e3, 2), "width_tokens": args.width_tokens})
            print(rows[-1], flush=True)
            report(rows, args)
    for batch, tokens in args.prefills:
        for variant in (v for v in variants if v not in DECODE_ONLY):
            us = min(launch_us(variant, batch, tokens, tokens, args.width_tokens, 3) for _ in range(2))
            rows.append({"kind": "prefill", "variant": variant, "batch": batch, "context": tokens, "us": round(us, 1),
                         "tflop_per_s": round(prefill_tflops(batch, tokens, tokens) / us * 1e6, 1),
                         "step_ms": round(LAYERS * us / 1e3, 2), "width_tokens": args.width_tokens})
            print(rows[-1], flush=True)
            report(rows, args)
    print(report(rows, args))
    return rows


def _context(row: dict) -> str:
    """The decode row's mean context, and its longest where the contexts spread (rows from before spreads have
    neither field)."""
    longest = row.get("longest", row["context"])
    return f"{row['context']}" if longest == row["context"] else f"{row['context']} ({longest})"


def report(rows: list[dict], args) -> str:
    """Write the rows so far to <out>/<name>.json|md (after every row: a failure later keeps them); the table."""
    decode = [r for r in rows if r.get("kind") == "decode"]
    prefill = [r for r in rows if r.get("kind") == "prefill"]
    table = markdown_table(["variant", "batch", "context (longest)", "us a layer", "floor us", "of floor",
                            "36 layers ms"],
                           [[r["variant"], r["batch"], _context(r), r["us"], r["floor_us"], r["of_floor"],
                             r["step_ms"]] for r in decode])
    if prefill:
        table += "\nPrefill steps (fresh prompts):\n\n" + markdown_table(
            ["variant", "requests", "tokens each", "us a layer", "TFLOP/s", "36 layers ms"],
            [[r["variant"], r["batch"], r["context"], r["us"], r["tflop_per_s"], r["step_ms"]] for r in prefill])
    table += "".join(f"\n{r['variant']}: first use (its check against sdpa_paged, compiling included), seconds: "
                     + ", ".join(f"{kind} {s}" for kind, s in r["seconds"].items()) + "\n"
                     for r in rows if r.get("kind") == "first_use")
    table += "".join(f"\n{r['variant']}: not run: {r['error']}\n" for r in rows if "error" in r)
    write_results(args.name, rows, table, args.out)
    return table


if __name__ == "__main__":
    sys.exit(exit_code(main()))
