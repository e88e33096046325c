"""Workload T: 128-token random prompts, 256 new tokens, greedy, batch 4 / 32 / 128, the Qwen3-4B shape with LoRA r32
live; cb_sync against its peers on one card, ratios from the same run only.

    python -m benchmarks throughput [--engines cb_sync_compiled cb_sync_exact hf_generate ...] [--batches 4 32 128]
        [--isolate [--time-limit S]] [--name NAME] [--out DIR]
    python -m benchmarks throughput --logprob-gap [--engines cb_sync cb_sync_exact] [--temperatures 1.0 0.1]
    python -m benchmarks throughput --engines cb_sync_exact --profile         # + a kernel table a batch size
    python -m benchmarks throughput --from-json A.json B.json --name NAME      # merge the rows of several runs
    python -m benchmarks throughput --tiny --out DIR          # CPU plumbing: the tiny model, fp32, a few tokens

Engines: cb_sync (uncompiled), cb_sync_compiled (the decode step compiled), cb_sync_exact (CBConfig(batch_invariant=
True): uncompiled), hf_generate (dynamic cache), hf_generate_static (static cache compiled by `generate`: a compile a
batch size), transformers_cb (transformers' continuous batching, CUDA graphs), and with --isolate vllm (the same
adapter through a LoRARequest) and vllm_nolora (merged weights, TRL's vLLM path; benchmarks.peers). --isolate runs each
engine in a process of its own; an engine that fails or runs out of time leaves rows with the reason. A cb_sync or
vLLM row is the median of 3 timed calls after a warm-up call, the other peers' one timed call (they take 3-20x
longer); `--no-lora-engines` also runs those engines with the adapter disabled.

--logprob-gap: requests sampled at each temperature (with logprobs) are scored again by a train-mode forward of the
same weights, as a trainer scores them (the exact mode through its own forward); per token |generator - trainer|:
mean, p95, max and the share of ratios outside [0.9, 1.1].
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from benchmarks.harness import (CB_MODES, RESULTS, bar_chart, build_model, call_floor_seconds, cb_config, exit_code,
                                free_cached_memory, gpu_state, markdown_table, mode_flags, profiled, random_prompts,
                                ratio, read_rows, run_engines, timed, write_results)

OUT = RESULTS / "throughput"
PREFILL_TOKENS = 16384      # cb_sync's max_batch_tokens: batch 128's prompts (128 x 128 tokens) in one step
REPEATS = 3                 # timed calls of a cb_sync row (the median is reported)
PEERS = ("hf_generate", "hf_generate_static", "transformers_cb", "vllm", "vllm_nolora")
VLLM_ENGINES = ("vllm", "vllm_nolora")
DEFAULT_ENGINES = ("cb_sync_compiled", "hf_generate", "transformers_cb")


class StepTimes(list):
    """A driver observer: its steps' outputs, and `split(seconds)`, a call's time in graph replays, eager steps and
    the rest. Replays launched one ahead of another's read share their chain's wall time equally."""

    def __call__(self, output) -> None:
        self.append(output)

    def split(self, seconds: float) -> dict:
        eager = [o.read_at - o.started_at for o in self if o.path != "replay"]
        chains = []
        for output in (o for o in self if o.path == "replay"):
            if output.ahead and chains:
                chains[-1].append(output)
            else:
                chains.append([output])
        replay_s = sum(chain[-1].read_at - chain[0].started_at for chain in chains)
        replays = sum(map(len, chains))
        return {"replay_step_ms": round(1e3 * replay_s / replays, 3) if replays else None,
                "eager_steps": len(eager), "eager_s": round(sum(eager), 3),
                "outside_steps_s": round(seconds - replay_s - sum(eager), 3)}


def run_cb_sync(engine: str, model, prompts, new_tokens: int, profile: Path | None = None):
    """cb_sync's timed calls; with a profile path, one more call under `harness.profiled`, its table there."""
    from cb_sync import SamplingParams, SyncCBDriver
    steps = StepTimes()
    config = cb_config(engine, max_batch_size=len(prompts), max_batch_tokens=PREFILL_TOKENS)
    driver = SyncCBDriver(model, config, observer=steps)
    params = SamplingParams(max_new_tokens=new_tokens)
    first, *_ = timed(lambda: driver.generate(prompts, params))
    calls = []
    for _ in range(REPEATS):
        steps.clear()
        seconds, peak, gc_s = timed(lambda: driver.generate(prompts, params))
        calls.append((seconds, peak, gc_s, steps.split(seconds)))
    if profile is not None:
        with profiled(profile, cuda=torch.cuda.is_available()):
            driver.generate(prompts, params)
    driver.release()
    seconds, _, gc_s, split = sorted(calls, key=lambda call: call[0])[len(calls) // 2]
    return seconds, max(call[1] for call in calls), {
        "first_call_s": round(first, 2), **split, "gc_s": round(gc_s, 4), "call_s": [round(c[0], 3) for c in calls]}


class StopAfter(StoppingCriteria):
    """Stops every row at `length` tokens: a warm-up call with the timed call's cache length (its compiled shapes)
    that decodes only a few tokens."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, device=input_ids.device)


class HFStepClock(StoppingCriteria):
    """Times HF `generate`'s steps by sequence length, and stops every row once time.monotonic() passes `deadline`
    (None: never). `generate` checks its criteria after every token and reads the answer on the host, so the times
    between checks are its steps."""

    def __init__(self, deadline: float | None = None):
        self.deadline = deadline
        self.ends = {}                  # sequence length -> time.perf_counter() when that token was checked

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.ends[input_ids.shape[1]] = time.perf_counter()
        stop = self.deadline is not None and time.monotonic() >= self.deadline
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    def ms_at(self, length: int, window: int) -> float | None:
        """The median step, in ms, that ended within `window` tokens of sequence `length` (None: none did)."""
        times = [1e3 * (self.ends[n] - self.ends[n - 1]) for n in self.ends
                 if n - 1 in self.ends and abs(n - length) <= window]
        return round(statistics.median(times), 3) if times else None


def run_hf_generate(model, prompts, new_tokens, static=False, warmup_tokens=None, clock: HFStepClock | None = None):
    """HF `generate`, dynamic cache, or static (compiled by `generate`: timed after a first call that compiles for
    this batch size and stops after warmup_tokens). clock: times the timed call's steps and may stop it."""
    ids = torch.tensor(prompts, device=model.device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
    extra = {}
    with torch.no_grad():
        if static:
            kwargs["cache_implementation"] = "static"
            stop = [StopAfter(ids.shape[1] + warmup_tokens)] if warmup_tokens else []
            if clock is not None:                   # the compiling call stops at the clock's deadline too
                stop.append(HFStepClock(clock.deadline))
            first, *_ = timed(lambda: model.generate(ids, stopping_criteria=StoppingCriteriaList(stop), **kwargs))
            extra = {"first_call_s": round(first, 2), "first_call_tokens": min(warmup_tokens or new_tokens,
                                                                               new_tokens)}
        criteria = StoppingCriteriaList([] if clock is None else [clock])
        seconds, peak, gc_s = timed(lambda: model.generate(ids, stopping_criteria=criteria, **kwargs))
    return seconds, peak, {**extra, "gc_s": round(gc_s, 4)}


def run_transformers_cb(model, prompts, new_tokens):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(use_cuda_graph=model.device.type == "cuda", max_memory_percent=0.5)
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    target.set_attn_implementation("paged|sdpa")
    try:
        with torch.no_grad():
            seconds, peak, gc_s = timed(lambda: model.generate_batch(prompts, generation_config=config,
                                                                     continuous_batching_config=cb))
    finally:
        target.set_attn_implementation("sdpa")
    return seconds, peak, {"gc_s": round(gc_s, 4)}


def run_engine(engine: str, model, prompts, new_tokens: int, profile: Path | None = None):
    if engine in CB_MODES:
        return run_cb_sync(engine, model, prompts, new_tokens, profile)
    if engine == "transformers_cb":
        return run_transformers_cb(model, prompts, new_tokens)
    return run_hf_generate(model, prompts, new_tokens, static=engine == "hf_generate_static")


def identity(engine: str, batch: int, lora: bool, args) -> dict:
    """What a row says whether it was measured or not."""
    return {"engine": engine, "workload": "T", "model": "qwen3-tiny" if args.tiny else "qwen3-4b-shape", "lora": lora,
            "batch": batch, "sampler": "greedy", "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            **mode_flags(engine)}


def measured(engine: str, batch: int, lora: bool, args, seconds: float, peak_gib: float | None, extra: dict) -> dict:
    floor = call_floor_seconds(batch, args.prompt_len, args.new_tokens, lora)
    return {**identity(engine, batch, lora, args), "tok_per_s": round(batch * args.new_tokens / seconds, 1),
            "seconds": round(seconds, 2), "peak_gib": None if peak_gib is None else round(peak_gib, 2),
            "pct_of_floor": None if args.tiny else round(100 * floor / seconds, 1), **extra, **gpu_state()}


def run_in_process(args) -> list[dict]:
    """Every engine here; compiled engines last, so that one compile serves every batch size."""
    model = build_model(lora=True, tiny=args.tiny)
    prompts = random_prompts(model.config.vocab_size, args.batches, args.prompt_len)
    jobs = [(engine, batch, lora) for compiled in (False, True) for batch in args.batches for engine in args.engines
            if engine.endswith("_compiled") == compiled
            for lora in ([True, False] if engine in args.no_lora_engines else [True])]
    rows = []
    for engine, batch, lora in jobs:
        free_cached_memory()             # what an engine left cached goes back before the next one runs
        try:
            with contextlib.nullcontext() if lora else model.disable_adapter():
                profile = (args.out / f"{args.name}_{engine}_b{batch}{'' if lora else '_nolora'}_profile.txt"
                           if args.profile else None)
                seconds, peak, extra = run_engine(engine, model, prompts[batch], args.new_tokens, profile)
        except Exception as error:       # a peer that fails is reported, not fatal
            print(f"{engine} batch {batch} failed: {error!r}", flush=True)
            continue
        rows.append(measured(engine, batch, lora, args, seconds, peak, extra))
        print(rows[-1], flush=True)
        save(rows, args)                 # after every row: a run cut short keeps its rows
    return rows


def run_isolated(args) -> list[dict]:
    """Each engine (all its batches) in a fresh process, vLLM last."""
    def command(engine: str, part: str, left):
        shared = ["--name", part, "--out", str(args.out), "--batches", *map(str, args.batches), "--prompt-len",
                  str(args.prompt_len), "--new-tokens", str(args.new_tokens), *(["--tiny"] * args.tiny),
                  *(["--profile"] * (args.profile and engine in CB_MODES))]
        if engine in VLLM_ENGINES:
            return [sys.executable, "-m", "benchmarks.peers", "vllm", "--engine", engine, "--workload", "T", *shared]
        return [sys.executable, "-m", "benchmarks.throughput", "--engines", engine, *shared, "--no-lora-engines",
                *[e for e in args.no_lora_engines if e == engine]]

    def expected(engine: str) -> list[dict]:
        adapters = [engine != "vllm_nolora"] + [False] * (engine in args.no_lora_engines)
        return [identity(engine, batch, lora, args) for batch in args.batches for lora in adapters]

    order = sorted(args.engines, key=lambda engine: (engine in VLLM_ENGINES, engine.endswith("_compiled")))
    return run_engines(order, command, expected, args.out, args.name, args.time_limit, lambda rows: save(rows, args))


# -- the exact mode's logprob gap ---------------------------------------------------------------------------------

def padded_batch(prompts, results):
    """input_ids / attention_mask [B, P + C]: prompts left-padded, completions right-padded, as TRL lays them out;
    with the prompts' width and the completions' longest."""
    width, keep = max(map(len, prompts)), max(len(r.token_ids) for r in results)
    ids = torch.zeros(len(prompts), width + keep, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        ids[i, width - len(prompt):width], mask[i, width - len(prompt):width] = torch.tensor(prompt), 1
        ids[i, width:width + len(result.token_ids)] = torch.tensor(result.token_ids)
        mask[i, width:width + len(result.token_ids)] = 1
    return ids, mask, width, keep


def trainer_logprobs(model, ids, mask, keep: int, temperature: float, config):
    """[B, keep] logprobs of the completion tokens from a train-mode forward without gradients, in the exact mode
    where the generator's config is."""
    from cb_sync.batch_invariant.trainer import invariant_token_logprobs
    model.train()
    try:
        with torch.no_grad():
            if config.batch_invariant:
                return invariant_token_logprobs(model, ids, mask, keep, temperature, config.block_size,
                                                config.lora_kernels, config.tuning.lora)[0]
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -keep - 1:-1]
            return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, ids[:, -keep:, None])[..., 0]
    finally:
        model.eval()


def logprob_gap(model, engine: str, prompts, new_tokens: int, temperature: float) -> dict:
    from cb_sync import SamplingParams, SyncCBDriver
    config = cb_config(engine, max_batch_size=len(prompts))
    params = [SamplingParams(max_new_tokens=new_tokens, do_sample=True, temperature=temperature, seed=i,
                             logprobs=True) for i in range(len(prompts))]
    driver = SyncCBDriver(model, config)
    results = driver.generate(prompts, params)
    driver.release()
    ids, mask, _, keep = padded_batch(prompts, results)
    device = next(model.parameters()).device
    trainer = trainer_logprobs(model, ids.to(device), mask.to(device), keep, temperature, config).float().cpu()
    deltas = torch.cat([trainer[i, :len(r.logprobs)] - torch.tensor(r.logprobs) for i, r in enumerate(results)])
    gap = deltas.abs()
    outside = (deltas > math.log(1.1)) | (deltas < math.log(0.9))
    return {"tokens": gap.numel(), "gap_mean": gap.mean().item(), "gap_p95": torch.quantile(gap, 0.95).item(),
            "gap_max": gap.max().item(), "ratio_outside": outside.float().mean().item(),
            "bitwise_equal": bool((deltas == 0).all())}


def run_logprob_gap(args) -> list[dict]:
    """Each cb_sync engine at each temperature, on 32 prompts of 16..prompt_len tokens (8 on --tiny)."""
    model = build_model(lora=True, tiny=args.tiny)
    count = 8 if args.tiny else 32
    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(min(16, args.prompt_len), args.prompt_len + 1, (count,), generator=gen).tolist()
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    rows = []
    for temperature in args.temperatures:
        for engine in (e for e in args.engines if e in CB_MODES):
            rows.append({"kind": "logprob_gap", "engine": engine, "temperature": temperature, **mode_flags(engine),
                         **logprob_gap(model, engine, prompts, min(args.new_tokens, 128), temperature)})
            print(rows[-1], flush=True)
    write_results(args.name, rows, gap_table(rows), args.out)
    return rows


def gap_table(rows: list[dict]) -> str:
    return markdown_table(
        ["temperature", "engine", "tokens", "mean |delta|", "p95", "max", "ratio outside [0.9, 1.1]", "bit-equal"],
        [[r["temperature"], r["engine"], r["tokens"], f"{r['gap_mean']:.3g}", f"{r['gap_p95']:.3g}",
          f"{r['gap_max']:.3g}", f"{r['ratio_outside']:.2%}", r["bitwise_equal"]] for r in rows])


# -- tables -------------------------------------------------------------------------------------------------------

def table(rows: list[dict]) -> str:
    """A line a row, with its ratio to every peer of the same batch and adapter (vllm_nolora: whatever the row's
    adapter, the race a GRPO user runs against merged weights); rows that could not run give their error."""
    peers = [r for r in rows if r.get("tok_per_s") and r["engine"] in PEERS]
    lines = []
    for row in rows:
        if not row.get("tok_per_s"):
            lines.append([row["engine"], "yes" if row["lora"] else "no", row["batch"], *["-"] * 6,
                          f"could not run: {row.get('error', 'no result')}"])
            continue
        ratios = [f"{ratio(row['tok_per_s'], p['tok_per_s'])} {p['engine']}" for p in peers
                  if row["engine"] not in PEERS and p["batch"] == row["batch"]
                  and (p["lora"] == row["lora"] or p["engine"] == "vllm_nolora")]
        card = f"{row['card_held_gib']} / {row['card_reserved_gib']}" if row.get("card_held_gib") is not None else "-"
        lines.append([row["engine"], "yes" if row["lora"] else "no", row["batch"], row["tok_per_s"],
                      "-" if row.get("peak_gib") is None else row["peak_gib"], card,
                      "-" if row.get("pct_of_floor") is None else f"{row['pct_of_floor']}%",
                      row.get("first_call_s", "-"), row.get("engine_start_s", "-"), ", ".join(ratios) or "-"])
    return markdown_table(["engine", "LoRA", "batch", "tok/s", "peak GiB", "card GiB held / reserved", "of floor",
                           "first call s", "engine start s", "vs peer (same run)"], lines)


def save(rows: list[dict], args) -> None:
    write_results(args.name, rows, table(rows), args.out)
    measured_rows = [row for row in rows if row.get("tok_per_s")]
    series = sorted({(r["engine"], r["lora"]) for r in measured_rows}, key=lambda s: (s[0] in PEERS, s[0], not s[1]))
    bar_chart({f"{engine} ({'LoRA' if lora else 'no adapter'})":
               {r["batch"]: r["tok_per_s"] for r in measured_rows if (r["engine"], r["lora"]) == (engine, lora)}
               for engine, lora in series}, args.out / f"{args.name}.png",
              "Workload T (Qwen3-4B shape, 128-token prompts, 256 new tokens)", log_scale=True)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=None,
                        choices=[*CB_MODES, "hf_generate", "hf_generate_static", "transformers_cb", *VLLM_ENGINES])
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 32, 128])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--no-lora-engines", nargs="*", default=[], help="engines that also run without the adapter")
    parser.add_argument("--profile", action="store_true",
                        help="cb_sync's engines: one more call under torch.profiler, its busiest kernels in "
                             "<out>/<name>_<engine>_b<batch>_profile.txt")
    parser.add_argument("--isolate", action="store_true", help="each engine in a process of its own")
    parser.add_argument("--time-limit", type=float, default=None, help="--isolate: seconds for all engines")
    parser.add_argument("--logprob-gap", action="store_true", help="the generator-vs-trainer gap of cb_sync's modes")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.1])
    parser.add_argument("--from-json", nargs="+", default=None, metavar="FILE", help="merge these runs' rows")
    parser.add_argument("--tiny", action="store_true", help="CPU plumbing: tiny model, batches 2 and 4, 8 + 8 tokens")
    parser.add_argument("--name", default=None, help="result files <out>/<name>.json|md|png")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    args.name = args.name or ("logprob_gap" if args.logprob_gap else "throughput")
    if args.from_json:
        rows = read_rows(args.from_json)
        save(rows, args)
        return rows
    if not args.isolate and set(args.engines or []) & set(VLLM_ENGINES):
        parser.error("vllm and vllm_nolora run with --isolate only (an engine start serves every batch)")
    if args.engines is None:        # on the CPU transformers' CB spends ~10 s a call starting
        args.engines = (["cb_sync", "cb_sync_exact"] if args.logprob_gap else ["cb_sync", "hf_generate"] if args.tiny
                        else list(DEFAULT_ENGINES))
    if args.tiny:
        args.batches, args.prompt_len, args.new_tokens = [2, 4], 8, 8
    if args.logprob_gap:
        return run_logprob_gap(args)
    rows = run_isolated(args) if args.isolate else run_in_process(args)
    save(rows, args)
    print(table(rows))
    return rows


if __name__ == "__main__":
    sys.exit(exit_code(main()))
