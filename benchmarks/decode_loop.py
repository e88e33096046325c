"""Driver loop probe: wall milliseconds per decode step of `generate` against the GPU time of that step's graph
replay, per sampler (greedy; grpo: Workload G's filtered sampling; grpo_autocast: the same under bf16 autocast,
as a trainer runs it). The difference is host time between replays (scheduling, input copies, reading the tokens back).
    python -m benchmarks.decode_loop [--batches 4 32] [--compile] [--profile FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS, build_model, markdown_table, write_results
from benchmarks.decode_graphs import _ms_per_call, kernel_profile
from cb_sync import CBConfig, SamplingParams, SyncCBDriver
from cb_sync.sampling.sampler import sampler_kind
from cb_sync.lora import lora_kernels
from cb_sync.model_patching.generation_mode import generation_mode

PROMPT, NEW = 256, 128
REPEATS = 3          # medians of three calls each
GRPO = SamplingParams(max_new_tokens=NEW, eos_token_id=[], do_sample=True, temperature=0.1, top_p=0.97, min_p=0.5,
                      top_k=5, seed=0)
SAMPLERS = {   # name: (params, under bf16 autocast)
    "greedy": (SamplingParams(max_new_tokens=NEW, eos_token_id=[]), False),
    "grpo": (GRPO, False),
    "grpo_autocast": (GRPO, True),
}


def _generate_seconds(driver, prompts, params) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    driver.generate(prompts, params)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def probe(model, batch: int, compile_model: bool, sampler: str, profile_to=None) -> dict:
    """Loop ms per decode step ((median time of NEW tokens - median time of 1 token) / (NEW - 1)) and replay ms
    of the bucket's graph left at the last step's inputs."""
    params, autocast = SAMPLERS[sampler]
    driver = SyncCBDriver(model, CBConfig(max_batch_size=batch, compile=compile_model, progress_bar=False))
    prompts = [[10 + (i * 7919 + j * 31) % 100_000 for j in range(PROMPT)] for i in range(batch)]
    first = dataclasses.replace(params, max_new_tokens=1)
    with torch.autocast("cuda", torch.bfloat16) if autocast else contextlib.nullcontext():
        _generate_seconds(driver, prompts, params)                      # cache, compile, capture
        whole = statistics.median(_generate_seconds(driver, prompts, params) for _ in range(REPEATS))
        prefill = statistics.median(_generate_seconds(driver, prompts, first) for _ in range(REPEATS))
        loop = (whole - prefill) / (NEW - 1)
        _generate_seconds(driver, prompts, params)                      # leave the buffers at the last step
        graph = driver.runner.replay.graphs.graphs[(batch, sampler_kind([params]))]
        with generation_mode(model), lora_kernels(model, True):
            replay = _ms_per_call(graph)
            if profile_to is not None:
                with open(profile_to, "a") as log:
                    log.write(kernel_profile(graph, f"batch {batch}, {sampler}, compile {compile_model}"))
    driver.release()
    return {"loop_ms": round(1e3 * loop, 2), "replay_ms": round(replay, 2),
            "host_ms": round(1e3 * loop - replay, 2)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--samplers", nargs="+", default=list(SAMPLERS), choices=list(SAMPLERS))
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--profile", default=None, help="append kernel profiles of the replays to this file")
    parser.add_argument("--name", default="decode_loop")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    model = build_model(lora=True)
    rows = []
    for batch in args.batches:
        for sampler in args.samplers:
            times = probe(model, batch, args.compile, sampler, args.profile)
            rows.append({"engine": "cb_sync", "model": "qwen3-4b-shape", "lora": True, "batch": batch,
                         "sampler": sampler, "compile": args.compile, "prompt": PROMPT, "new_tokens": NEW, **times})
            print(rows[-1], flush=True)
    table = markdown_table(["batch", "sampler", "loop ms / step", "replay ms", "host ms"],
                           [[r["batch"], r["sampler"], r["loop_ms"], r["replay_ms"], r["host_ms"]] for r in rows])
    write_results(args.name, rows, table, args.out)
    print(table)


if __name__ == "__main__":
    main()
