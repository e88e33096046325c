"""Same-run A/B of two cb_sync trees: Workload T (Qwen3-4B shape + LoRA r32, 128-token prompts, 256 new tokens,
greedy, batch 4 / 32 / 128) and GRPO's sampler alone (4 copies of a 130-token prompt, 512 new tokens, temperature 0.1,
top_p 0.97, min_p 0.5, top_k 5, EOS silenced), both compiled. Each tree runs in a process of its own and uses only
the public API (SyncCBDriver, CBConfig, SamplingParams), so any revision can be measured:
    git worktree add /tmp/before REV && python -m benchmarks.step_path_ab --tree /tmp/before --label before
    python -m benchmarks.step_path_ab --label after                        # this tree
    python -m benchmarks.step_path_ab --merge before.json after.json --name step_path_ab
Each row is the median of REPEATS timed calls after a warm-up call (which compiles and captures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

REPEATS = 3
BATCHES = (4, 32, 128)


def measure(label: str) -> list[dict]:
    from cb_sync import CBConfig, SamplingParams, SyncCBDriver
    from benchmarks.common import build_model, cuda_seconds, floor_seconds_per_step
    model = build_model(lora=True)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    grpo = SamplingParams(max_new_tokens=512, do_sample=True, temperature=0.1, top_p=0.97, min_p=0.5, top_k=5,
                          eos_token_id=[])
    cases = [("T", batch, torch.randint(0, vocab, (batch, 128), generator=gen).tolist(),
              SamplingParams(max_new_tokens=256, eos_token_id=[]), 16384) for batch in BATCHES]
    cases.append(("grpo_sampler", 4, torch.randint(0, vocab, (1, 130), generator=gen).tolist() * 4, grpo, 512))
    rows = []
    for workload, batch, prompts, params, batch_tokens in cases:
        driver = SyncCBDriver(model, CBConfig(max_batch_size=batch, max_batch_tokens=batch_tokens, compile=True,
                                              progress_bar=False))
        torch.cuda.reset_peak_memory_stats()
        first = cuda_seconds(lambda: driver.generate(prompts, params))
        calls = [cuda_seconds(lambda: driver.generate(prompts, params)) for _ in range(REPEATS)]
        seconds = statistics.median(calls)
        new = params.max_new_tokens
        floor = new * floor_seconds_per_step(batch, len(prompts[0]) + new // 2, True)
        rows.append({"engine": "cb_sync_compiled", "code": label, "workload": workload, "model": "qwen3-4b-shape",
                     "lora": True, "batch": batch, "prompt_len": len(prompts[0]), "new_tokens": new,
                     "tok_per_s": round(batch * new / seconds, 1), "seconds": round(seconds, 3),
                     "pct_of_floor": round(100 * floor / seconds, 1),
                     "ms_per_step": round(1e3 * seconds / new, 3),
                     "call_s": [round(c, 3) for c in calls], "first_call_s": round(first, 2),
                     "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)})
        print(rows[-1], flush=True)
        driver.release()
        del driver
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    from benchmarks.common import markdown_table
    keyed = {(r["code"], r["workload"], r["batch"]): r for r in rows}
    out = []
    for workload, batch in sorted({(r["workload"], r["batch"]) for r in rows}, key=lambda k: (k[0] != "T", k[1])):
        before, after = keyed.get(("before", workload, batch)), keyed.get(("after", workload, batch))
        ratio = f"{after['tok_per_s'] / before['tok_per_s']:.3f}" if before and after else "-"
        out.append([workload, batch, before["tok_per_s"] if before else "-", after["tok_per_s"] if after else "-",
                    ratio, before["ms_per_step"] if before else "-", after["ms_per_step"] if after else "-"])
    return markdown_table(["workload", "batch", "before tok/s", "after tok/s", "after / before", "before ms/step",
                           "after ms/step"], out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", help="a checkout whose cb_sync is measured (default: this one)")
    parser.add_argument("--label", default="after")
    parser.add_argument("--merge", nargs="+", type=Path, help="merge these result files into one table")
    parser.add_argument("--name", default="step_path_ab")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    from benchmarks.common import write_results
    if args.merge:
        rows = [row for path in args.merge for row in json.loads(path.read_text())]
    else:
        if args.tree:
            sys.path.insert(0, str(Path(args.tree).resolve()))
        rows = measure(args.label)
        args.name = f"{args.name}_{args.label}"
    write_results(args.name, rows, table(rows), args.out)
    print(table(rows))


if __name__ == "__main__":
    main()
