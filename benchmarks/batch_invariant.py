"""Batch-invariant mode, measured in one run on the Qwen3-4B shape + LoRA r32 (bf16, random weights):

1. cost: decode tok/s of Workload T (prompts of 128 tokens, 256 new tokens, greedy) at each batch, CBConfig() (graphs,
   LoRA kernels, uncompiled) against CBConfig(batch_invariant=True) (LoRA kernel in its fixed tiling), the median of
   `--repeats` calls after a warm-up; at `--peft-batches` also batch-invariant mode with lora_kernels=False (PEFT's
   LoRA in row blocks), and with `--lora-variants` other LoRA tunings; `--profile FILE`: a torch.profiler table of
   one batch-invariant call at the first batch;
2. mismatch: requests sampled at each temperature (with logprobs), scored again by a trainer-side forward of the same
   weights in train mode, as TRL scores them: the default mode against HF's own forward (sdpa, log_softmax of
   logits / T), the batch-invariant mode against `invariant_forward`; mean, p95, max |delta| per token and the share
   of ratios outside [0.9, 1.1].
    python -m benchmarks.batch_invariant [--batches 4 32 128] [--peft-batches 4] [--temperatures 1.0 0.1] [--tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import build_model, markdown_table, write_results
from cb_sync import CBConfig, SamplingParams, SyncCBDriver
from cb_sync.batch_invariant.trainer import invariant_logits, invariant_logprobs
from cb_sync.tuning import KernelTuning, LoraTuning


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=gen).tolist()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode_rate(model, config: CBConfig, prompts, new_tokens: int, repeats: int, device: str) -> dict:
    driver = SyncCBDriver(model, config)
    params = SamplingParams(max_new_tokens=new_tokens)
    driver.generate(prompts, params)
    seconds = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        driver.generate(prompts, params)
        _sync(device)
        seconds.append(time.perf_counter() - start)
    driver.release()
    median = statistics.median(seconds)
    return {"tok_s": round(len(prompts) * new_tokens / median, 1), "call_s": [round(s, 3) for s in seconds]}


def profile_call(model, config: CBConfig, prompts, new_tokens: int, path: Path) -> None:
    """One warm call under torch.profiler: the kernels by GPU time into path."""
    driver = SyncCBDriver(model, config)
    params = SamplingParams(max_new_tokens=new_tokens)
    driver.generate(prompts, params)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as profiler:
        driver.generate(prompts, params)
        torch.cuda.synchronize()
    driver.release()
    path.write_text(profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=40,
                                                  max_name_column_width=60))


def padded_batch(prompts, results):
    """input_ids / attention_mask [B, P + C]: prompts left-padded, completions right-padded, as TRL lays them out."""
    width, keep = max(map(len, prompts)), max(len(r.token_ids) for r in results)
    ids = torch.zeros(len(prompts), width + keep, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        ids[i, width - len(prompt):width], mask[i, width - len(prompt):width] = torch.tensor(prompt), 1
        ids[i, width:width + len(result.token_ids)] = torch.tensor(result.token_ids)
        mask[i, width:width + len(result.token_ids)] = 1
    return ids, mask, width, keep


def trainer_logprobs(model, ids, mask, keep: int, temperature: float, config: CBConfig):
    """[B, keep] logprobs of the completion tokens from a train-mode forward without gradients (batch-invariant as
    the generator's config is)."""
    model.train()
    try:
        with torch.no_grad():
            if config.batch_invariant:
                logits = invariant_logits(model, ids, mask, keep, config.block_size, config.lora_kernels,
                                          config.tuning.lora)
                return invariant_logprobs(logits, ids[:, -keep:], temperature)
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -keep - 1:-1]
            logps = torch.log_softmax(logits.float() / temperature, dim=-1)
            return logps.gather(-1, ids[:, -keep:, None])[..., 0]
    finally:
        model.eval()


def mismatch(model, config: CBConfig, prompts, new_tokens: int, temperature: float) -> dict:
    params = [SamplingParams(max_new_tokens=new_tokens, do_sample=True, temperature=temperature, seed=i,
                             logprobs=True) for i in range(len(prompts))]
    driver = SyncCBDriver(model, config)
    results = driver.generate(prompts, params)
    driver.release()
    device = next(model.parameters()).device
    ids, mask, width, keep = padded_batch(prompts, results)
    trainer = trainer_logprobs(model, ids.to(device), mask.to(device), keep, temperature, config).float().cpu()
    deltas = torch.cat([trainer[i, :len(r.logprobs)] - torch.tensor(r.logprobs) for i, r in enumerate(results)])
    gap = deltas.abs()
    outside = (deltas > math.log(1.1)) | (deltas < math.log(0.9))
    return {"tokens": gap.numel(), "gap_mean": gap.mean().item(), "gap_p95": torch.quantile(gap, 0.95).item(),
            "gap_max": gap.max().item(), "ratio_outside": outside.float().mean().item(),
            "bitwise_equal": bool((deltas == 0).all())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 32, 128])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.1])
    parser.add_argument("--mismatch-requests", type=int, default=32)
    parser.add_argument("--mismatch-tokens", type=int, default=128)
    parser.add_argument("--peft-batches", type=int, nargs="*", default=[4])
    parser.add_argument("--lora-variants", nargs="*", default=[], metavar="NAME:FIELD=V,...",
                        help="more batch-invariant rows with these LoraTuning fields (e.g. m32:fixed_block_m=32)")
    parser.add_argument("--profile", type=Path, default=None, metavar="FILE")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: the 2-layer shape in fp32")
    parser.add_argument("--name", default="batch_invariant")
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    model = build_model(lora=True, tiny=args.tiny, device=device, dtype=torch.float32 if args.tiny else torch.bfloat16)
    vocab = model.config.vocab_size
    modes = {"default": lambda batch: CBConfig(max_batch_size=batch),
             "batch_invariant": lambda batch: CBConfig(max_batch_size=batch, batch_invariant=True),
             "batch_invariant_peft": lambda batch: CBConfig(max_batch_size=batch, batch_invariant=True,
                                                            lora_kernels=False)}
    for variant in args.lora_variants:
        name, _, settings = variant.partition(":")
        fields = {key: int(value) for key, value in (item.split("=") for item in settings.split(",") if item)}
        tuning = KernelTuning(lora=dataclasses.replace(LoraTuning(), **fields))
        modes[f"batch_invariant_{name}"] = lambda batch, tuning=tuning: CBConfig(max_batch_size=batch,
                                                                                  batch_invariant=True, tuning=tuning)
    rows = []
    for batch in args.batches:
        prompts = _prompts(batch, args.prompt_len, vocab, seed=batch)
        rates = {mode: decode_rate(model, make(batch), prompts, args.new_tokens, args.repeats, device)
                 for mode, make in modes.items() if mode != "batch_invariant_peft" or batch in args.peft_batches}
        rows.append({"kind": "cost", "batch": batch, **{f"{m}_tok_s": r["tok_s"] for m, r in rates.items()},
                     **{f"{m}_ratio": round(r["tok_s"] / rates["default"]["tok_s"], 3) for m, r in rates.items()},
                     "calls": rates})
        print(rows[-1], flush=True)
        if args.profile and batch == args.batches[0]:
            profile_call(model, modes["batch_invariant"](batch), prompts, args.new_tokens, args.profile)
    prompts = [p[:n] for p, n in zip(_prompts(args.mismatch_requests, args.prompt_len, vocab, seed=7),
                                     torch.randint(16, args.prompt_len + 1, (args.mismatch_requests,),
                                                   generator=torch.Generator().manual_seed(8)).tolist())]
    for temperature in args.temperatures:
        for mode in ("default", "batch_invariant"):
            make = modes[mode]
            rows.append({"kind": "mismatch", "mode": mode, "temperature": temperature,
                         **mismatch(model, make(len(prompts)), prompts, args.mismatch_tokens, temperature)})
            print(rows[-1], flush=True)
    cost = [r for r in rows if r["kind"] == "cost"]
    gaps = [r for r in rows if r["kind"] == "mismatch"]
    table = markdown_table(["batch", "mode", "tok/s", "ratio to default"],
                           [[r["batch"], mode, r[f"{mode}_tok_s"], r[f"{mode}_ratio"]] for r in cost for mode in modes
                            if f"{mode}_tok_s" in r])
    table += "\n" + markdown_table(
        ["temperature", "mode", "tokens", "mean |delta|", "p95", "max", "ratio outside [0.9, 1.1]", "bit-equal"],
        [[r["temperature"], r["mode"], r["tokens"], f"{r['gap_mean']:.3g}", f"{r['gap_p95']:.3g}",
          f"{r['gap_max']:.3g}", f"{r['ratio_outside']:.2%}", r["bitwise_equal"]] for r in gaps])
    write_results(args.name, rows, table)
    print(table)


if __name__ == "__main__":
    main()
