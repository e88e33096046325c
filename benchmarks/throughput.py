"""Workload T: 128-token random prompts, 256 new tokens, greedy, batch 4/32/128, Qwen3-4B shape (+ LoRA r32).

cb_sync and its peers run on the same card in one run; the table gives ratios from this run only.
    python -m benchmarks.throughput [--batches 4 32 128] [--engines cb_sync cb_sync_compiled hf_generate ...]
    python -m benchmarks.throughput --tiny --out DIR     # CPU plumbing check: tiny Qwen3, fp32, a few tokens

Engines: cb_sync (decode graphs, Triton LoRA kernel), cb_sync_peft_lora (PEFT's LoRA forward), cb_sync_compiled
(+ torch.compile, which also runs the steps that are not pure decode; compiled engines run after the others so that
one compile serves every batch), hf_generate, hf_generate_static
(static cache, compiled by `generate`; not run by default: a compile per batch size), transformers_cb; with
--isolate also vllm (LoRA r32 through vLLM's LoRARequest) and vllm_nolora (benchmarks/peers_vllm.py: one engine
serves every batch size, its start is timed, and its rows record the card's memory it holds and reserves).

With --isolate each engine runs in a process of its own (all its batch sizes), one after the other; without it, all
run in this process. --time-limit bounds an isolated run: an engine still running then is stopped, and its missing
rows say so, as the rows of an engine that failed carry its error. Each row is one engine at one batch size after a
warm-up call: cb_sync's and vLLM's rows give the median of REPEATS timed calls (all in `call_s`), the other peers'
one timed call (they take 3-20x longer). Between rows the process collects its garbage and returns cached GPU memory;
each row records the cyclic garbage collector's pauses within its timed calls (`gc_s`), the objects it tracks, the
live threads and the card's temperature, clock and power after the row.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from benchmarks.common import (RESULTS, build_model, floor_seconds_per_step, gpu_state, grouped_bars, markdown_table,
                               write_results)
from benchmarks.isolation import run_child

PREFILL_TOKENS = 16384   # cb_sync's max_batch_tokens: the prompts of batch 128 (128 x 128 tokens) in one step
REPEATS = 3              # timed calls per cb_sync row (the median is reported)


def _timed(fn):
    """Seconds, peak GiB of GPU memory (0 on the CPU) and seconds of garbage-collector pauses of fn()."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with _gc_pauses() as pauses:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return seconds, torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0, pauses[0]


@contextlib.contextmanager
def _gc_pauses():
    """A one-item list that holds, on leaving the block, the seconds the cyclic garbage collector ran within it."""
    total, started = [0.0], []

    def callback(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            total[0] += time.perf_counter() - started.pop()
    gc.callbacks.append(callback)
    try:
        yield total
    finally:
        gc.callbacks.remove(callback)


def run_cb_sync(model, prompts, new_tokens, compile_model=False, lora_kernels=True):
    from cb_sync import CBConfig, SamplingParams, SyncCBDriver
    steps = StepTimes()
    driver = SyncCBDriver(model, CBConfig(max_batch_size=max(len(prompts), 1), max_batch_tokens=PREFILL_TOKENS,
                                          compile=compile_model, lora_kernels=lora_kernels), observer=steps)
    params = SamplingParams(max_new_tokens=new_tokens)
    warmup, *_ = _timed(lambda: driver.generate(prompts, params))
    replay = driver.runner.replay
    timings = {"first_call_s": round(warmup, 2), "graph_warmup_s": round(replay.warmup_seconds, 2) if replay else 0,
               "capture_s": round(replay.graphs.capture_seconds, 2) if replay else 0}
    calls = []
    for _ in range(REPEATS):
        steps.clear()
        seconds, peak, gc_s = _timed(lambda: driver.generate(prompts, params))
        calls.append((seconds, peak, gc_s, steps.split(seconds)))
    driver.release()
    seconds, _, gc_s, median_call = sorted(calls, key=lambda call: call[0])[len(calls) // 2]
    return seconds, max(call[1] for call in calls), {**timings, **median_call, "gc_s": round(gc_s, 4),
                                                     "call_s": [round(call[0], 3) for call in calls]}


class StepTimes(list):
    """A driver observer: the outputs of a call's steps, and `split(seconds)`, the call's time split into graph
    replays, eager steps and the rest. An eager step ends with the host read of its tokens, so its wall time is
    its whole time; replays launched one ahead of another's read share their chain's wall time equally."""

    def __call__(self, output) -> None:
        self.append(output)

    def split(self, seconds: float) -> dict:
        eager = [o.read_at - o.started_at for o in self if o.path != "replay"]
        chains = []
        for output in self:
            if output.path == "replay":
                if output.ahead and chains:
                    chains[-1].append(output)
                else:
                    chains.append([output])
        replay_s = sum(chain[-1].read_at - chain[0].started_at for chain in chains)
        replays = sum(len(chain) for chain in chains)
        return {"replay_steps": replays, "replay_step_ms": round(1e3 * replay_s / replays, 3) if replays else None,
                "eager_steps": len(eager), "eager_s": round(sum(eager), 3),
                "outside_steps_s": round(seconds - replay_s - sum(eager), 3)}


class StopAfter(StoppingCriteria):
    """Stops every row once the sequences are `length` tokens long: a warm-up call that keeps the call's cache
    length (so its compiled shapes) but decodes only a few tokens."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, device=input_ids.device)


class HFStepClock(StoppingCriteria):
    """Times HF `generate`'s steps by sequence length, and stops every row once time.monotonic() passes `deadline`
    (None: never). `generate` checks its criteria after every token and reads on the host whether rows are left, at
    most a step late, so the host keeps within a step of the device and the times between checks are its steps."""

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


def run_hf_generate(model, prompts, new_tokens, static=False, warmup_tokens=None,
                    clock: HFStepClock | None = None):
    """HF `generate` with its dynamic cache, or with a static cache (which `generate` compiles: timed warm, after
    a first call that compiles for this batch size; warmup_tokens: that call stops after so many new tokens).
    clock: times the timed call's steps, and may stop it at its deadline (its `ends` say how far it got)."""
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
            first, *_ = _timed(lambda: model.generate(ids, stopping_criteria=StoppingCriteriaList(stop), **kwargs))
            extra["first_call_s"] = round(first, 2)
            extra["first_call_tokens"] = min(warmup_tokens or new_tokens, new_tokens)
        timed = StoppingCriteriaList([] if clock is None else [clock])
        seconds, peak, gc_s = _timed(lambda: model.generate(ids, stopping_criteria=timed, **kwargs))
    return seconds, peak, {**extra, "gc_s": round(gc_s, 4)}


def run_transformers_cb(model, prompts, new_tokens):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb_config = ContinuousBatchingConfig(use_cuda_graph=model.device.type == "cuda", max_memory_percent=0.5)
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    target.set_attn_implementation("paged|sdpa")
    try:
        with torch.no_grad():
            seconds, peak, gc_s = _timed(lambda: model.generate_batch(prompts, generation_config=config,
                                                                      continuous_batching_config=cb_config))
    finally:
        target.set_attn_implementation("sdpa")
    return seconds, peak, {"gc_s": round(gc_s, 4)}


ENGINES = {
    "cb_sync": run_cb_sync,                                                   # graphs + Triton LoRA kernel
    "cb_sync_peft_lora": lambda *a: run_cb_sync(*a, lora_kernels=False),      # graphs, PEFT's LoRA forward
    "cb_sync_compiled": lambda *a: run_cb_sync(*a, compile_model=True),       # + torch.compile
    "hf_generate": run_hf_generate,
    "hf_generate_static": lambda *a: run_hf_generate(*a, static=True),     # + static cache, compiled by HF
    "transformers_cb": run_transformers_cb,
}
VLLM_ENGINES = ("vllm", "vllm_nolora")          # --isolate only: benchmarks.peers_vllm, one engine per process
PEERS = ("hf_generate", "hf_generate_static", "transformers_cb", *VLLM_ENGINES)
CROSS_ADAPTER_PEERS = ("vllm_nolora",)           # compared with every row of its batch, with or without an adapter
DEFAULT_ENGINES = ("cb_sync", "hf_generate", "transformers_cb")   # hf_generate_static compiles per batch size


def make_prompts(vocab_size: int, batches: list[int], prompt_len: int) -> dict[int, list[list[int]]]:
    """The random prompts of every batch size, the same for every engine and process."""
    gen = torch.Generator().manual_seed(0)
    return {batch: torch.randint(0, vocab_size, (batch, prompt_len), generator=gen).tolist() for batch in batches}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 32, 128])
    parser.add_argument("--engines", nargs="+", default=list(DEFAULT_ENGINES), choices=[*ENGINES, *VLLM_ENGINES])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--no-lora-engines", nargs="*", default=["cb_sync"], choices=list(ENGINES),
                        help="engines that also run with the adapter disabled")
    parser.add_argument("--name", default="throughput")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tiny", action="store_true",
                        help="CPU plumbing check: tiny Qwen3 in fp32, batches 2 and 4, 8-token prompts, 8 new tokens")
    parser.add_argument("--from-json", nargs="*", default=None, metavar="FILE",
                        help="measure nothing: redraw <out>/<name>.md and .png from <out>/<name>.json; with FILEs, "
                             "that json is first their rows merged (runs of one machine, in several calls)")
    parser.add_argument("--isolate", action="store_true",
                        help="each engine in a process of its own, one after the other, on the same card")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="--isolate: seconds for all engines together; an engine still running then is stopped")
    args = parser.parse_args(argv)
    if not args.isolate and set(args.engines) & set(VLLM_ENGINES):
        parser.error(f"{', '.join(VLLM_ENGINES)} run with --isolate only (one engine start serves every batch)")
    if args.from_json is not None:
        if args.from_json:
            merged = [row for path in args.from_json for row in json.loads(Path(path).read_text())]
            (args.out / f"{args.name}.json").write_text(json.dumps(merged, indent=1))
        rows = json.loads((args.out / f"{args.name}.json").read_text())
        (args.out / f"{args.name}.md").write_text(_table(rows))
        plot([row for row in rows if row.get("tok_per_s")], args.out / f"{args.name}.png")
        return
    if args.tiny and args.engines == list(DEFAULT_ENGINES):   # transformers CB spends ~10 s a call starting on the CPU
        args.engines = ["cb_sync", "hf_generate"]
    if args.tiny:
        args.batches, args.prompt_len, args.new_tokens = [2, 4], 8, 8
    if args.isolate:
        return _isolated(args)
    if args.tiny:
        model = build_model(lora=True, tiny=True, device="cpu", dtype=torch.float32)
    else:
        model = build_model(lora=True)
    prompts = make_prompts(model.config.vocab_size, args.batches, args.prompt_len)
    jobs = []
    for compiled in (False, True):      # compiled engines last: their one compile serves every batch size
        for batch in args.batches:
            for engine in args.engines:
                if engine.endswith("_compiled") == compiled:
                    jobs.append((engine, batch, True))
                    if engine in args.no_lora_engines:
                        jobs.append((engine, batch, False))
    rows = []
    for engine, batch, lora in jobs:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()         # what an engine left cached is returned before the next one runs
        state = {"gc_objects": len(gc.get_objects()), "threads": threading.active_count()}
        try:
            with contextlib.nullcontext() if lora else model.disable_adapter():
                seconds, peak, extra = ENGINES[engine](model, prompts[batch], args.new_tokens)
        except Exception as error:                   # a peer that fails is reported, not fatal
            print(f"{engine} batch {batch} failed: {error!r}", flush=True)
            continue
        extra = {**extra, **state, **gpu_state()}
        tok_s = batch * args.new_tokens / seconds
        floor = args.new_tokens * floor_seconds_per_step(batch, args.prompt_len + args.new_tokens // 2, lora)
        rows.append({"engine": engine, "model": "qwen3-tiny" if args.tiny else "qwen3-4b-shape", "lora": lora,
                     "batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "tok_per_s": round(tok_s, 1), "seconds": round(seconds, 2), "peak_gib": round(peak, 2),
                     "pct_of_floor": None if args.tiny else round(100 * floor / seconds, 1), **extra})
        print(rows[-1], flush=True)
        write_results(args.name, rows, _table(rows), args.out)   # after every row: a run cut short keeps its rows
    plot(rows, args.out / f"{args.name}.png")
    print(_table(rows))
    return rows


def _isolated(args) -> list[dict]:
    """Run each engine (all its batches) in a fresh process, in the order the jobs would run in one process (the
    vLLM engines last), so that no engine runs after what another left behind (threads, cached memory, compiled
    state, an engine's worker: its process group is ended and the card's memory awaited); merge their rows. A row
    an engine did not write is a row with the reason."""
    order = sorted(args.engines, key=lambda engine: (engine in VLLM_ENGINES, engine.endswith("_compiled")))
    stop = None if args.time_limit is None else time.monotonic() + args.time_limit
    rows = []
    for engine in order:
        name = f"{args.name}_{engine}"
        left = None if stop is None else stop - time.monotonic()
        if left is not None and left <= 0:
            rows += _missing_rows(engine, args, [], "not run: the run's --time-limit was used up")
            continue
        outcome = run_child(_engine_command(engine, args, name), timeout=left)
        path = args.out / f"{name}.json"
        got = [{**row, "process": "own"} for row in json.loads(path.read_text())] if path.is_file() else []
        rows += got + _missing_rows(engine, args, got, outcome.reason(left), outcome.tail)
        for suffix in (".json", ".md", ".png"):
            (args.out / f"{name}{suffix}").unlink(missing_ok=True)
        write_results(args.name, rows, _table(rows), args.out)
    plot([row for row in rows if row.get("tok_per_s")], args.out / f"{args.name}.png")
    print(_table(rows))
    return rows


def _engine_command(engine: str, args, name: str) -> list[str]:
    shared = ["--name", name, "--out", str(args.out), "--batches", *map(str, args.batches), "--prompt-len",
              str(args.prompt_len), "--new-tokens", str(args.new_tokens), *(["--tiny"] if args.tiny else [])]
    if engine in VLLM_ENGINES:
        return [sys.executable, "-m", "benchmarks.peers_vllm", "--engine", engine, *shared]
    return [sys.executable, "-m", "benchmarks.throughput", "--engines", engine, *shared, "--no-lora-engines",
            *[e for e in args.no_lora_engines if e == engine]]


def _expected(engine: str, args) -> list[tuple[int, bool]]:
    """(batch, lora) of every row the engine should write."""
    adapters = [engine != "vllm_nolora"] + ([False] if engine in args.no_lora_engines and engine not in
                                            VLLM_ENGINES else [])
    return [(batch, lora) for batch in args.batches for lora in adapters]


def _missing_rows(engine: str, args, got: list[dict], reason: str, tail: list[str] = ()) -> list[dict]:
    """A row with the reason for every (batch, lora) the engine left out; the engine's own 'failed' line for that
    batch, where it printed one, is the reason."""
    have = {(row["batch"], row["lora"]) for row in got}
    rows = []
    for batch, lora in _expected(engine, args):
        if (batch, lora) in have:
            continue
        printed = [line for line in tail if line.startswith(f"{engine} batch {batch} failed:")]
        rows.append({"engine": engine, "model": "qwen3-tiny" if args.tiny else "qwen3-4b-shape", "lora": lora,
                     "batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "process": "own",
                     "error": printed[-1] if printed else reason})
    return rows


def plot(rows: list[dict], path) -> None:
    """Tokens per second per engine (with / without LoRA) and batch size, log scale; skipped without matplotlib."""
    series = sorted({(r["engine"], r["lora"]) for r in rows}, key=lambda s: (s[0] in PEERS, s[0], not s[1]))
    grouped_bars({f"{engine} ({'LoRA' if lora else 'no adapter'})":
                  {r["batch"]: r["tok_per_s"] for r in rows if (r["engine"], r["lora"]) == (engine, lora)}
                  for engine, lora in series}, path,
                 "Workload T (Qwen3-4B shape, 128-token prompts, 256 new tokens), one run", log_scale=True)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a < 10 * b else f"{a / b:.1f}x"


def _table(rows):
    """One line per row; an engine's ratio to every peer of the same run at its batch size and adapter setting
    (to vllm_nolora whatever its setting); rows that could not run give their error."""
    measured = [r for r in rows if r.get("tok_per_s")]
    out = []
    for row in rows:
        if not row.get("tok_per_s"):
            out.append([row["engine"], "yes" if row["lora"] else "no", row["batch"], "-", "-", "-", "-", "-", "-",
                        f"could not run: {row.get('error', 'no result')}"])
            continue
        ratios = []
        for peer in measured:
            if peer["engine"] in PEERS and row["engine"] not in PEERS and peer["batch"] == row["batch"] and (
                    peer["lora"] == row["lora"] or peer["engine"] in CROSS_ADAPTER_PEERS):
                ratios.append(f"{_ratio(row['tok_per_s'], peer['tok_per_s'])} {peer['engine']}")
        card = (f"{row['card_held_gib']} / {row['card_reserved_gib']}" if row.get("card_held_gib") is not None
                else "-")
        out.append([row["engine"], "yes" if row["lora"] else "no", row["batch"], row["tok_per_s"],
                    "-" if row.get("peak_gib") is None else row["peak_gib"], card,
                    "-" if row.get("pct_of_floor") is None else f"{row['pct_of_floor']}%",
                    row.get("first_call_s", "-"), row.get("engine_start_s", "-"), ", ".join(ratios) or "-"])
    return markdown_table(["engine", "LoRA", "batch", "tok/s", "peak GiB", "card GiB held / reserved", "of floor",
                           "first call s", "engine start s", "vs peer (same run)"], out)


if __name__ == "__main__":
    main()
