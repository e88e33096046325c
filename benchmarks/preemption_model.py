"""What a KV cap costs a Workload L call, predicted without a model: cb_sync's own Scheduler is replayed step by step
(every request sampling one token a step, EOS silenced) against a cache of the cap's blocks, with a clock of the
roofline: a step reads the weights, the adapter and its requests' KV once at the card's copy bandwidth, and a token
it prefills (a prompt, or one recomputed after preemption) costs PREFILL_S_PER_TOKEN (16,384 tokens of Qwen3-4B +
LoRA prefill measured 359 ms on the H200, NOTES attempt 10). Rows: the cap, its blocks, steps, preemptions, tokens
recomputed, predicted seconds and tok/s, the share of the uncapped prediction, and (json) the predicted seconds by
step kind and of the decode steps by running batch, as `long_rollouts` measures them. A prediction to check against
`long_rollouts --max-cache-gib`, not a measurement.

`--step-times FILE` replaces the roofline with a clock fitted to measured decode steps: the uncapped cb_sync rows of
a `long_rollouts` json (their median step at 1k / 4k / 8k of context), ms = a + b x requests + c x KV GB, where the KV
is priced as the decode kernel spends it: requests x the longest request's context (it splits every request's context
into the same number of partitions, so the longest request's partitions set the step). In an uncapped call every
context is the same; in a capped one the running requests' contexts differ.

    python -m benchmarks.preemption_model [--batch 64] [--caps 96 48 32 16] [--prompt-len 1024] [--new-tokens 8192]
        [--step-times benchmarks/results/long_rollouts_l4.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from types import SimpleNamespace

from benchmarks.common import KV_BYTES_PER_TOKEN, RESULTS, floor_seconds, markdown_table, write_results
from benchmarks.long_rollouts import ContextSteps
from cb_sync.engine.block_allocator import BlockAllocator
from cb_sync.config import SamplingParams
from cb_sync.engine.request import Request
from cb_sync.engine.scheduler import Scheduler

PREFILL_S_PER_TOKEN = 0.359 / 16384
BLOCK_SIZE = 16


def roofline_ms(contexts: list[int]) -> float:
    """A decode step at its floor: the weights, the adapter and the requests' KV (`contexts`: each request's tokens)
    read once at the copy bandwidth."""
    return 1e3 * floor_seconds(sum(contexts) * KV_BYTES_PER_TOKEN, lora=True)


def fitted_clock(path: Path):
    """ms = a + b x requests + c x KV GB, least squares over the uncapped cb_sync rows' measured steps in `path` (a
    long_rollouts json). Returns (clock, coefficients); the clock prices a step's `contexts` (each request's tokens)
    with KV GB = requests x the longest context, as the decode kernel's partitions spend it."""
    points = [(row["batch"], row["batch"] * int(key.rsplit("_", 1)[1]) * KV_BYTES_PER_TOKEN / 1e9, row[key])
              for row in json.loads(Path(path).read_text())
              if row.get("engine", "").startswith("cb_sync") and not row.get("preemptions") and row.get("tok_per_s")
              for key in row if key.startswith("ms_step_") and row[key] is not None]
    if len(points) < 3:
        raise ValueError(f"{path}: {len(points)} measured decode steps of uncapped cb_sync rows, at least 3 needed")
    design = np.array([[1.0, requests, kv_gb] for requests, kv_gb, _ in points])
    a, b, c = np.linalg.lstsq(design, np.array([ms for *_, ms in points]), rcond=None)[0]
    def clock(contexts: list[int]) -> float:
        return a + b * len(contexts) + c * len(contexts) * max(contexts) * KV_BYTES_PER_TOKEN / 1e9
    return clock, (round(a, 4), round(b, 5), round(c, 5))


def replay(batch: int, prompt_len: int, new_tokens: int, cap_gib: float, max_batch_tokens: int,
           step_ms=roofline_ms) -> dict:
    """One call through the Scheduler against `cap_gib` of KV blocks; distinct prompts (no prefix shared); a step's
    decode rows cost step_ms(each request's context), its prefilled tokens PREFILL_S_PER_TOKEN each."""
    num_blocks = int(cap_gib * 2**30) // (KV_BYTES_PER_TOKEN * BLOCK_SIZE)
    scheduler = Scheduler(BlockAllocator(num_blocks), BLOCK_SIZE, max_batch_tokens, batch, prefix_sharing=False)
    params = SamplingParams(max_new_tokens=new_tokens, eos_token_id=[])
    requests = [Request(i, [i] * prompt_len, params, seed=0, eos_ids=frozenset()) for i in range(batch)]
    for request in requests:
        scheduler.add(request)
    steps, seconds, fed = 0, 0.0, ContextSteps()     # fed: what each request was fed again
    while scheduler.has_work():
        plan = scheduler.schedule()
        if not plan:
            raise ValueError(f"a cap of {cap_gib} GiB ({num_blocks} blocks) cannot hold one request")
        prefilled = sum(chunk.length for chunk in plan if chunk.length > 1)
        seconds += (step_ms([chunk.start + chunk.length for chunk in plan]) / 1e3
                    + prefilled * PREFILL_S_PER_TOKEN)
        fed(SimpleNamespace(plan=plan, path="replay", read_at=seconds))
        sampled = [chunk.request for chunk in plan if chunk.samples]
        scheduler.update(plan, sampled, [0] * len(sampled), [0.0] * len(sampled))
        steps += 1
    return {"batch": batch, "cap_gib": cap_gib, "blocks": num_blocks, "steps": steps,
            "preemptions": sum(r.num_preemptions for r in requests), "recomputed_tokens": fed.recomputed,
            "seconds": round(seconds, 1), "tok_per_s": round(batch * new_tokens / seconds, 1),
            "seconds_by_kind": fed.seconds_by_kind(), "decode_by_batch": fed.decode_by_batch()}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--caps", type=float, nargs="+", default=[96, 48, 32, 16], help="KV caps, GiB")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=8192)
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--step-times", type=Path, default=None, metavar="JSON",
                        help="a long_rollouts json: the decode clock fitted to its uncapped cb_sync steps")
    parser.add_argument("--name", default="preemption_model")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    clock, clock_name = roofline_ms, "roofline"
    if args.step_times is not None:
        clock, coefficients = fitted_clock(args.step_times)
        clock_name = (f"ms = {coefficients[0]} + {coefficients[1]} x requests + {coefficients[2]} x KV GB (requests x "
                      "the longest context)")
    rows = [{**replay(args.batch, args.prompt_len, args.new_tokens, cap, args.max_batch_tokens, clock),
             "clock": clock_name} for cap in args.caps]
    uncapped = max(rows, key=lambda r: r["tok_per_s"])["tok_per_s"]
    for row in rows:
        row["of_best"] = round(row["tok_per_s"] / uncapped, 3)
    table = markdown_table(["cap GiB", "blocks", "steps", "preemptions", "tokens recomputed", "predicted s",
                            "predicted tok/s", "of the best cap"],
                           [[f"{r['cap_gib']:g}", r["blocks"], r["steps"], r["preemptions"],
                             f"{r['recomputed_tokens']:,}", r["seconds"], r["tok_per_s"], r["of_best"]] for r in rows])
    table += f"\nDecode clock: {clock_name}.\n"
    write_results(args.name, rows, table, args.out)
    print(table)
    return rows


if __name__ == "__main__":
    main()
