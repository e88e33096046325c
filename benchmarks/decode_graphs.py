"""Decode-step probe: milliseconds per pure-decode step per bucket, eager vs graph replay (vs compiled graph),
with and without LoRA, and % of the bandwidth floor. Every row of the batch has a 384-token context.
    python -m benchmarks.decode_graphs [--batches 4 32 128] [--compile]
        [--peft-lora | --lora-alone | --base-by-torch] [--lora-only] [--profile FILE]

--profile appends, per probe, the GPU kernels of five graph replays grouped by kind (GEMM, Triton, attention,
copies, other: count and microseconds per step) and the top kernels by GPU time.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import torch

from benchmarks.common import RESULTS, build_model, floor_seconds_per_step, markdown_table, write_results
from cb_sync import CBConfig, SamplingParams, SyncCBDriver
from cb_sync.lora import lora_kernels as lora_kernels_for, peft_forward as fast_forward
from cb_sync.model_patching.generation_mode import generation_mode
from cb_sync.sampling.sampler import SamplerKind
from cb_sync.tuning import KernelTuning, LoraTuning

CONTEXT = 384
KINDS = (("attention", ("_decode_", "_prefill_kernel", "_store_kv")),
         ("lora", ("_shrink_kernel", "_expand_kernel")),
         ("gemm", ("gemm", "nvjet", "cutlass", "sm90_", "gemv")),
         ("triton", ("triton_",)),
         ("copy", ("memcpy", "memset", "copy", "Memcpy", "Memset")))


def _ms_per_call(fn, repeats: int = 20) -> float:
    fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / repeats


def kernel_profile(fn, label: str, repeats: int = 5) -> str:
    """Per-step GPU kernel counts and time by kind, and the top kernels, over `repeats` calls of fn."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    kernels = [(e.key, e.count / repeats, e.self_device_time_total / repeats) for e in prof.key_averages()
               if e.self_device_time_total > 0]
    by_kind = {}
    for name, count, us in kernels:
        kind = next((k for k, marks in KINDS if any(m in name for m in marks)), "other")
        total = by_kind.setdefault(kind, [0.0, 0.0])
        total[0] += count
        total[1] += us
    lines = [f"## {label}: {sum(c for _, c, _ in kernels):.0f} kernels, {sum(u for *_, u in kernels):.0f} us GPU "
             "time per step"]
    lines += [f"  {kind:10s} {count:7.0f} kernels {us:9.1f} us" for kind, (count, us) in sorted(by_kind.items())]
    lines += [f"    {us:9.1f} us {count:6.1f}x  {name[:110]}" for name, count, us in
              sorted(kernels, key=lambda k: -k[2])[:25]]
    return "\n".join(lines) + "\n"


def probe(model, batch: int, compile_model: bool, lora_kernels: bool = True, profile_to=None, label: str = "",
          tuning: KernelTuning = KernelTuning()) -> dict:
    """Fill the static buffers with `batch` rows at context CONTEXT and time eager step vs replay."""
    driver = SyncCBDriver(model, CBConfig(max_batch_size=batch, max_batch_tokens=8192, compile=compile_model,
                                          lora_kernels=lora_kernels, tuning=tuning))
    driver.generate([[1] * (CONTEXT - 4)] * batch, SamplingParams(max_new_tokens=4))   # cache + capture
    replay, per_row = driver.runner.replay, -(-CONTEXT // driver.cache.block_size)
    inputs, greedy = replay.buffers.views, SamplerKind.GREEDY
    with generation_mode(model), lora_kernels_for(model, lora_kernels, tuning=tuning.lora):
        rows = torch.arange(batch, device="cuda")
        inputs["tables"][:batch, :per_row] = (rows[:, None] * per_row + torch.arange(per_row, device="cuda")).int()
        inputs["positions"][:batch] = CONTEXT - 1
        inputs["seq_lens"][:batch] = CONTEXT
        inputs["slots"][:batch] = inputs["tables"][:batch, (CONTEXT - 1) // 16].long() * 16 + (CONTEXT - 1) % 16
        eager = _ms_per_call(lambda: replay.decode_step(batch, greedy), repeats=5)
        graph = replay.graphs.graphs[(batch, greedy)]
        replayed = _ms_per_call(graph)
        if profile_to is not None:
            with open(profile_to, "a") as log:
                for name, fn in (("graph replay", graph),
                                 ("uncaptured step", lambda: replay.decode_step(batch, greedy))):
                    try:
                        log.write(kernel_profile(fn, f"{label} {name}"))
                    except Exception as error:      # a profiler problem must not end the probe
                        log.write(f"## {label} {name}: profile failed: {error!r}\n")
    driver.release()
    return {"eager_ms": round(eager, 2), "graph_ms": round(replayed, 2)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 32, 128])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--peft-lora", action="store_true", help="PEFT's LoRA forward instead of the LoRA kernel")
    parser.add_argument("--lora-alone", action="store_true",
                        help="one LoRA kernel launch pair per projection (no shared-input groups), for comparison")
    parser.add_argument("--base-by-torch", action="store_true",
                        help="the LoRA kernel adds to torch's base GEMMs instead of computing them itself")
    parser.add_argument("--lora-only", action="store_true", help="leave out the rows without LoRA")
    parser.add_argument("--profile", default=None, help="append kernel profiles to this file")
    parser.add_argument("--name", default="decode_graphs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.lora_alone:
        fast_forward.SHARED_INPUT = ()
    tuning = KernelTuning(lora=LoraTuning(fused_base_max_rows=0)) if args.base_by_torch else KernelTuning()
    model = build_model(lora=True)
    rows = []
    for batch in args.batches:
        for lora in (True,) if args.lora_only else (True, False):
            path = ("PEFT" if args.peft_lora else "kernel alone" if args.lora_alone
                    else "kernel, base by torch" if args.base_by_torch else "kernel")
            label = (f"batch {batch}, LoRA {path if lora else 'off'}, "
                     f"compile {'on' if args.compile else 'off'}")
            with contextlib.nullcontext() if lora else model.disable_adapter():
                times = probe(model, batch, args.compile, not args.peft_lora, args.profile, label, tuning)
            floor_ms = 1e3 * floor_seconds_per_step(batch, CONTEXT, lora)
            rows.append({"engine": "cb_sync", "model": "qwen3-4b-shape", "lora": lora, "batch": batch,
                         "lora_path": path.replace(",", "").replace(" ", "_").lower() if lora else None,
                         "context": CONTEXT, "compile": args.compile, **times, "floor_ms": round(floor_ms, 2),
                         "graph_pct_of_floor": round(100 * floor_ms / times["graph_ms"], 1)})
            print(rows[-1], flush=True)
    table = markdown_table(
        ["LoRA", "batch", "eager ms", "graph ms" + (" (compiled)" if args.compile else ""), "floor ms", "of floor"],
        [["yes" if r["lora"] else "no", r["batch"], r["eager_ms"], r["graph_ms"], r["floor_ms"],
          f"{r['graph_pct_of_floor']}%"] for r in rows])
    write_results(args.name, rows, table, args.out)
    print(table)


if __name__ == "__main__":
    main()
