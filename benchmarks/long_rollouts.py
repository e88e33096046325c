"""Workload L: reasoning-length rollouts. The Qwen3-4B shape with LoRA r32 live, 1,024-token random prompts, 8,192
new tokens (EOS silenced), batch 8 / 32 / 64, greedy or GRPO's sampler (TRL's default: temperature 1, no filter).

    python -m benchmarks long_rollouts [--engines cb_sync_compiled vllm vllm_nolora hf_generate ...] [--batches 8 32 64]
        [--sampler greedy|grpo] [--max-cache-gib 96 [16 ...]] [--attn-backend auto|triton|flash|flash_prefill]
        [--time-limit S] [--name NAME] [--out DIR]
    python -m benchmarks long_rollouts --from-json A.json B.json --name NAME       # merge the rows of several runs
    python -m benchmarks long_rollouts --predict-caps 96 48 32 16 [--step-times L.json]   # a KV cap's cost, CPU
    python -m benchmarks long_rollouts --tiny --out DIR       # CPU plumbing: the tiny model, a few tokens

Each engine runs in a process of its own, one after the other. A row is one engine at one batch: one timed call after
a warm-up call that builds what the timed call uses (cb_sync: one request as long as the workload's, which captures
the decode graphs at the cache's width; vLLM: the batch with 16 new tokens; HF's static cache: a call stopped after 16
tokens). Rows give tok/s of the whole call, its share of the call's bandwidth floor, peak memory (vLLM: the card's
memory it holds), and for cb_sync the KV it allocated, its preemptions and the tokens they made it recompute (a
`--max-cache-gib` below a batch's need forces them; several caps: a row each, one driver), its time by kind of step,
and the median replayed decode step at 1k / 4k / 8k (16k) tokens of context against that step's floor. An HF call
still running when its time runs out stops there; its row is the rate over the tokens it made.

--predict-caps replays cb_sync's own FIFOScheduler against each cap's blocks (every request sampling one token a step),
with a clock: the step's roofline (and a measured prefill rate), or with --step-times a clock fitted to a run's
measured uncapped steps, ms = a + b x requests + c x KV GB, the KV priced as the decode kernel spends it: requests x
the longest request's context. A prediction to check against `--max-cache-gib`, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.harness import (CB_MODES, KV_BYTES_PER_TOKEN, RESULTS, bar_chart, build_model, call_floor_seconds,
                                cb_config, copy_bandwidth, exit_code, floor_seconds, floor_seconds_per_step,
                                free_cached_memory, gpu_state, markdown_table, mode_flags, random_prompts, read_rows,
                                row_key, run_engines, write_results)

OUT = RESULTS / "long_rollouts"
CONTEXTS = (1024, 4096, 8192, 16384)     # where a decode step's time is reported
CONTEXT_WINDOW = 64                      # steps within this many tokens of a context count for it
WARMUP_TOKENS = 16
MAX_BATCH_TOKENS = 16384                 # cb_sync's token budget a step: 16 of the 1,024-token prompts
HF_ENGINES = ("hf_generate", "hf_generate_static")
VLLM_ENGINES = ("vllm", "vllm_nolora")
HF_EXIT_MARGIN_S = 45                    # an HF process stops its call this long before it is stopped
PREFILL_S_PER_TOKEN = 0.359 / 16384      # 16,384 tokens of 4B + LoRA prefill took 359 ms on an H200
BLOCK_SIZE = 16


class ContextSteps:
    """A driver observer: every step's output, its longest context and KV tokens; the requests it saw (their
    preemptions) and `recomputed`, the tokens fed again below a request's furthest position already computed."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.steps, self.requests, self.furthest, self.recomputed = [], {}, {}, 0

    def __call__(self, output) -> None:
        for chunk in output.plan:
            key, end = id(chunk.request), chunk.start + chunk.length
            self.requests[key] = chunk.request
            self.recomputed += max(0, min(end, self.furthest.get(key, 0)) - chunk.start)
            self.furthest[key] = max(end, self.furthest.get(key, 0))
        ends = [chunk.start + chunk.length for chunk in output.plan]
        self.steps.append((output, max(ends), sum(ends)))

    def _read_to_read(self):
        """(previous step, step, its longest context, its KV tokens), each step timed from the previous read."""
        for (prev, *_), (out, context, kv) in zip(self.steps, self.steps[1:]):
            if out.read_at is not None and prev.read_at is not None:
                yield prev, out, context, kv

    def ms_at(self, context: int) -> float | None:
        """The median replayed step (after a replay) within CONTEXT_WINDOW tokens of `context`."""
        times = [1e3 * (out.read_at - prev.read_at) for prev, out, ctx, _ in self._read_to_read()
                 if out.path == prev.path == "replay" and abs(ctx - context) <= CONTEXT_WINDOW]
        return round(statistics.median(times), 3) if times else None

    def decode_by_batch(self) -> dict[str, list]:
        """[steps, seconds, mean requests, mean KV tokens] of pure-decode steps per running batch (1, 2-3, 4-7, ...)."""
        buckets = {}
        for prev, out, _, kv in self._read_to_read():
            if all(chunk.length == 1 for chunk in out.plan):
                low = 1 << (len(out.plan).bit_length() - 1)
                totals = buckets.setdefault((low, 2 * low - 1), [0, 0.0, 0, 0])
                for i, value in enumerate((1, out.read_at - prev.read_at, len(out.plan), kv)):
                    totals[i] += value
        return {(f"{low}" if low == high else f"{low}-{high}"): [n, round(s, 3), round(r / n, 2), round(kv / n)]
                for (low, high), (n, s, r, kv) in sorted(buckets.items())}

    def seconds_by_kind(self) -> dict[str, list]:
        """[steps, seconds] by path and kind ("replay decode", "eager prefill", "compiled mixed", ...)."""
        totals = {}
        for prev, out, _, _ in self._read_to_read():
            decodes = sum(chunk.length == 1 for chunk in out.plan)
            key = f"{out.path} " + ("decode" if decodes == len(out.plan) else "mixed" if decodes else "prefill")
            count, seconds = totals.get(key, (0, 0.0))
            totals[key] = (count + 1, seconds + out.read_at - prev.read_at)
        return {key: [count, round(seconds, 2)] for key, (count, seconds) in sorted(totals.items())}

    def preemptions(self) -> int:
        return sum(request.num_preemptions for request in self.requests.values())


def identity(engine: str, batch: int, args, cap: float | None = None) -> dict:
    """What a row says whether it was measured or not."""
    row = {"engine": engine, "workload": "L", "batch": batch, "lora": engine != "vllm_nolora", "sampler": args.sampler,
           "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, **mode_flags(engine)}
    return {**row, "max_cache_gib": cap, "attn_backend": args.attn_backend} if engine in CB_MODES else row


def measured(engine: str, batch: int, args, seconds: float, peak_gib: float, made: int | None = None,
             cap: float | None = None) -> dict:
    """A measured row; made: the new tokens a call made where it stopped short of the workload's."""
    made = args.new_tokens if made is None else made
    row = identity(engine, batch, args, cap)
    floor = call_floor_seconds(batch, args.prompt_len, made, row["lora"])
    return {**row, "model": "qwen3-tiny" if args.tiny else "qwen3-4b-shape",
            "tok_per_s": round(batch * made / seconds, 1), "seconds": round(seconds, 2),
            "peak_gib": round(peak_gib, 2), "pct_of_floor": None if args.tiny else round(100 * floor / seconds, 1),
            **({"stopped_after_tokens": made} if made < args.new_tokens else {}), **gpu_state()}


def run_cb_sync(engine: str, model, prompts: dict, args, on_row) -> list[dict]:
    """One driver serves every cap and batch (one compile; graphs captured once at the cache's width); between caps
    the cache is released (the graphs kept) and the next call allocates it within the new cap."""
    from cb_sync import SamplingParams, SyncCBDriver
    steps = ContextSteps()
    driver = SyncCBDriver(model, cb_config(engine, max_batch_size=max(args.batches), max_batch_tokens=MAX_BATCH_TOKENS,
                                           max_cache_gib=args.max_cache_gib[0], attn_backend=args.attn_backend,
                                           progress_bar=False), observer=steps)
    length = args.prompt_len + args.new_tokens
    params = lambda n: SamplingParams(max_new_tokens=n, do_sample=args.sampler == "grpo", temperature=1.0,  # noqa
                                      eos_token_id=[])
    start = time.perf_counter()
    driver.generate([prompts[min(prompts)][0][:1] * (length - WARMUP_TOKENS)], params(WARMUP_TOKENS), seed=0)
    warmup_s = time.perf_counter() - start
    rows = []
    for cap, batch in ((cap, batch) for cap in args.max_cache_gib for batch in args.batches):
        if cap != driver.config.max_cache_gib:
            driver.release(keep_graphs=True)
            driver.config = dataclasses.replace(driver.config, max_cache_gib=cap)
        steps.clear()
        free_cached_memory()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        results = driver.generate(prompts[batch], params(args.new_tokens), seed=0)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if {len(r.token_ids) for r in results} != {args.new_tokens} or len(results) != batch:
            raise RuntimeError(f"batch {batch}: expected {batch} completions of {args.new_tokens} tokens")
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
        rows.append({**measured(engine, batch, args, seconds, peak, cap=cap), "warmup_s": round(warmup_s, 1),
                     "kv_gib": round(driver.cache.nbytes / 2**30, 2), "preemptions": steps.preemptions(),
                     "recomputed_tokens": steps.recomputed, "seconds_by_kind": steps.seconds_by_kind(),
                     "decode_by_batch": steps.decode_by_batch(),
                     **{f"ms_step_{c}": steps.ms_at(c) for c in CONTEXTS if c <= length},
                     **{f"floor_ms_{c}": round(1e3 * floor_seconds_per_step(batch, c, True), 3) for c in CONTEXTS
                        if c <= length}})
        print(rows[-1], flush=True)
        on_row(rows)
    driver.release()
    return rows


def run_hf_generate(engine: str, model, prompts: dict, args, on_row) -> list[dict]:
    """HF `generate`, the adapter live, greedy, its steps timed; with --stop-at a call still running then stops
    there (its row counts the tokens made), a batch not started by then is a row saying so."""
    from benchmarks.throughput import HFStepClock, run_hf_generate as generate
    deadline = None if args.stop_at is None else time.monotonic() + args.stop_at - time.time()
    length, rows = args.prompt_len + args.new_tokens, []
    for batch in args.batches:
        if deadline is not None and time.monotonic() >= deadline:
            rows.append({**identity(engine, batch, args), "error": "not run: --time-limit used up"})
            continue
        clock = HFStepClock(deadline)
        try:
            seconds, peak, extra = generate(model, prompts[batch], args.new_tokens, static=engine.endswith("static"),
                                            warmup_tokens=WARMUP_TOKENS, clock=clock)
            rows.append({**measured(engine, batch, args, seconds, peak, max(clock.ends) - args.prompt_len), **extra,
                         **{f"ms_step_{c}": clock.ms_at(c, CONTEXT_WINDOW) for c in CONTEXTS if c <= length}})
        except Exception as error:
            rows.append({**identity(engine, batch, args), "error": f"{error!r}"[:500]})
        print(rows[-1], flush=True)
        on_row(rows)
        free_cached_memory()
    return rows


def engine_main(args) -> list[dict]:
    """One cb_sync or HF engine in this process: its rows to <out>/<name>.json after each batch."""
    copy_bandwidth()            # a card not in COPY_BANDWIDTHS is measured before it fills up
    model = build_model(lora=True, tiny=args.tiny)
    prompts = random_prompts(model.config.vocab_size, args.batches, args.prompt_len)
    save = lambda rows: write_results(args.name, rows, table(rows), args.out)   # noqa: E731
    run = run_hf_generate if args.engines[0] in HF_ENGINES else run_cb_sync
    rows = run(args.engines[0], model, prompts, args, save)
    save(rows)
    return rows


def run_all(args) -> list[dict]:
    """Every engine in a process of its own, vLLM last; a row an engine did not write carries the reason."""
    def command(engine: str, part: str, left: float | None) -> list[str]:
        shared = ["--name", part, "--out", str(args.out), "--batches", *map(str, args.batches), "--prompt-len",
                  str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--sampler", args.sampler,
                  *(["--tiny"] * args.tiny)]
        if engine in VLLM_ENGINES:
            return [sys.executable, "-m", "benchmarks.peers", "vllm", "--engine", engine, "--workload", "L", *shared,
                    "--repeats", "1", "--warmup-tokens", str(WARMUP_TOKENS)]
        if engine in HF_ENGINES and left is not None:
            shared += ["--stop-at", repr(time.time() + left - HF_EXIT_MARGIN_S)]
        return [sys.executable, "-m", "benchmarks.long_rollouts", "--engines", engine, "--engine-process", *shared,
                "--max-cache-gib", *map(str, args.max_cache_gib), "--attn-backend", args.attn_backend]

    def expected(engine: str) -> list[dict]:
        caps = args.max_cache_gib if engine in CB_MODES else [None]
        return [identity(engine, batch, args, cap) for cap in caps for batch in args.batches]

    return run_engines(sorted(args.engines, key=lambda e: e in VLLM_ENGINES), command, expected, args.out, args.name,
                       args.time_limit, lambda rows: save(rows, args.name, args.out))


# -- a KV cap's cost, predicted -----------------------------------------------------------------------------------

def roofline_ms(contexts: list[int]) -> float:
    """A decode step at its floor: the weights, the adapter and the requests' KV read once."""
    return 1e3 * floor_seconds(sum(contexts) * KV_BYTES_PER_TOKEN, lora=True)


def fitted_clock(path: Path):
    """ms = a + b x requests + c x KV GB, least squares over the uncapped cb_sync rows' measured steps in `path`.
    Returns (clock, coefficients); the clock prices a step's contexts with KV = requests x the longest context."""
    import numpy as np
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
    """One call through the FIFOScheduler against `cap_gib` of KV blocks (distinct prompts); a step costs
    step_ms(each request's context) and PREFILL_S_PER_TOKEN a prefilled token."""
    from cb_sync.cache import BlockAllocator
    from cb_sync.config import SamplingParams
    from cb_sync.scheduler import FIFOScheduler, Request
    num_blocks = int(cap_gib * 2**30) // (KV_BYTES_PER_TOKEN * BLOCK_SIZE)
    scheduler = FIFOScheduler(BlockAllocator(num_blocks), BLOCK_SIZE, max_batch_tokens, batch, prefix_sharing=False)
    params = SamplingParams(max_new_tokens=new_tokens, eos_token_id=[])
    requests = [Request(i, [i] * prompt_len, params, seed=0, eos_ids=frozenset()) for i in range(batch)]
    for request in requests:
        scheduler.add(request)
    steps, seconds, fed = 0, 0.0, ContextSteps()
    while scheduler.has_work():
        plan = scheduler.schedule()
        if not plan:
            raise ValueError(f"a cap of {cap_gib} GiB ({num_blocks} blocks) cannot hold one request")
        prefilled = sum(chunk.length for chunk in plan if chunk.length > 1)
        seconds += step_ms([chunk.start + chunk.length for chunk in plan]) / 1e3 + prefilled * PREFILL_S_PER_TOKEN
        fed(SimpleNamespace(plan=plan, path="replay", read_at=seconds))
        sampled = [chunk.request for chunk in plan if chunk.samples]
        scheduler.update(plan, sampled, [0] * len(sampled), [0.0] * len(sampled))
        steps += 1
    return {"batch": batch, "cap_gib": cap_gib, "blocks": num_blocks, "steps": steps,
            "preemptions": sum(r.num_preemptions for r in requests), "recomputed_tokens": fed.recomputed,
            "seconds": round(seconds, 1), "tok_per_s": round(batch * new_tokens / seconds, 1),
            "seconds_by_kind": fed.seconds_by_kind(), "decode_by_batch": fed.decode_by_batch()}


def predict(args) -> list[dict]:
    clock, clock_name = roofline_ms, "the step's roofline"
    if args.step_times is not None:
        clock, (a, b, c) = fitted_clock(args.step_times)
        clock_name = f"ms = {a} + {b} x requests + {c} x KV GB (requests x the longest context)"
    rows = [{**replay(batch, args.prompt_len, args.new_tokens, cap, MAX_BATCH_TOKENS, clock), "clock": clock_name}
            for batch in args.batches for cap in args.predict_caps]
    for row in rows:
        row["of_best"] = round(row["tok_per_s"] / max(r["tok_per_s"] for r in rows if r["batch"] == row["batch"]), 3)
    text = markdown_table(["batch", "cap GiB", "blocks", "steps", "preemptions", "tokens recomputed", "predicted s",
                           "predicted tok/s", "of the best cap"],
                          [[r["batch"], f"{r['cap_gib']:g}", r["blocks"], r["steps"], r["preemptions"],
                            f"{r['recomputed_tokens']:,}", r["seconds"], r["tok_per_s"], r["of_best"]] for r in rows])
    write_results(args.name, rows, f"{text}\nDecode clock: {clock_name}.\n", args.out)
    print(text)
    return rows


# -- tables -------------------------------------------------------------------------------------------------------

def label(row: dict) -> str:
    engine = row["engine"] if row.get("attn_backend") in ("auto", None) else f"{row['engine']} {row['attn_backend']}"
    if row.get("max_cache_gib") is not None:
        return f"{engine} (cap {row['max_cache_gib']:g} GiB)"
    return engine if row["engine"] != "vllm_nolora" else "vllm_nolora (merged weights)"


def _stopped(row: dict) -> str:
    made = row.get("stopped_after_tokens")
    return "" if made is None else f" (its first {made:,} tokens: stopped at the time limit)"


def comparable(a: dict, b: dict) -> bool:
    """The same workload (batch, sampler, lengths) on the same card (a row that names none matches any)."""
    cards = [row.get("gpu") or row.get("card") for row in (a, b)]
    return row_key(a)[2:6] == row_key(b)[2:6] and (None in cards or cards[0] == cards[1])


def table(rows: list[dict]) -> str:
    """A line a row, cb_sync's with its ratio to every peer row of the same workload measured on the same card."""
    peers = [r for r in rows if r.get("tok_per_s") and r["engine"] in (*VLLM_ENGINES, *HF_ENGINES)]
    lines = []
    for row in rows:
        if not row.get("tok_per_s"):
            lines.append([label(row), row.get("sampler", "-"), row["batch"], *["-"] * 9,
                          f"could not run: {row.get('error', 'no result')}"])
            continue
        ratios = [f"{row['tok_per_s'] / p['tok_per_s']:.2f}x {p['engine']}{_stopped(p)}" for p in peers
                  if row["engine"] in CB_MODES and comparable(p, row)]
        cells = lambda prefix: " / ".join(str(row.get(f"{prefix}{c}") or "-") for c in CONTEXTS)   # noqa: E731
        memory = row["peak_gib"] if row.get("card_held_gib") is None else (
            f"{row['card_held_gib']} held / {row['card_reserved_gib']} reserved")
        preempted = (f"{row['preemptions']} ({row['recomputed_tokens']:,})" if "preemptions" in row else "-")
        lines.append([label(row) + _stopped(row), row.get("sampler", "-"), row["batch"], row["tok_per_s"],
                      row["seconds"], "-" if row.get("pct_of_floor") is None else f"{row['pct_of_floor']}%",
                      cells("ms_step_"), cells("floor_ms_"), memory, row.get("kv_gib", "-"), preempted,
                      row.get("engine_start_s", row.get("warmup_s", "-")), ", ".join(ratios) or "-"])
    headers = ["engine", "sampler", "batch", "tok/s", "s", "of floor", "ms/step at 1k / 4k / 8k / 16k",
               "floor ms at 1k / 4k / 8k / 16k", "peak GiB", "KV GiB", "preemptions (tokens recomputed)",
               "engine start (cb_sync: warm-up) s", "vs peers (same card)"]
    return f"{caption(rows)}\n\n{markdown_table(headers, lines)}"


def caption(rows: list[dict]) -> str:
    lengths = " or ".join(sorted({f"{r.get('prompt_len', 1024):,}-token prompts, {r.get('new_tokens', 8192):,} new "
                                  "tokens" for r in rows}))
    return f"Workload L (Qwen3-4B shape + LoRA r32, {lengths})"


def save(rows: list[dict], name: str, out: Path) -> None:
    write_results(name, rows, table(rows), out)
    measured_rows = sorted((r for r in rows if r.get("tok_per_s")),
                           key=lambda r: (r["engine"] in VLLM_ENGINES, r["engine"], -(r.get("max_cache_gib") or 0)))
    bar_chart({label(row): {r["batch"]: r["tok_per_s"] for r in measured_rows if label(r) == label(row)}
               for row in measured_rows}, out / f"{name}.png", caption(rows))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=["cb_sync_compiled", *VLLM_ENGINES],
                        choices=[*CB_MODES, *HF_ENGINES, *VLLM_ENGINES])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--sampler", choices=["greedy", "grpo"], default="greedy")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=8192)
    parser.add_argument("--max-cache-gib", type=float, nargs="+", default=[96.0],
                        help="cb_sync's KV caps (CBConfig.max_cache_gib): a row for each cap and batch")
    parser.add_argument("--attn-backend", default="auto", choices=["auto", "triton", "flash", "flash_prefill"])
    parser.add_argument("--time-limit", type=float, default=None, help="seconds for all engines together")
    parser.add_argument("--from-json", nargs="+", default=None, metavar="FILE",
                        help="merge these runs' rows; an error row of a workload another file measured is dropped")
    parser.add_argument("--predict-caps", type=float, nargs="+", default=None, metavar="GIB",
                        help="replay the scheduler against these KV caps (batches: --batches)")
    parser.add_argument("--step-times", type=Path, default=None, metavar="JSON",
                        help="--predict-caps: the clock fitted to this run's uncapped cb_sync steps")
    parser.add_argument("--tiny", action="store_true", help="CPU plumbing: batches 2 and 3, 8 + 40 tokens")
    parser.add_argument("--name", default=None)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--engine-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stop-at", type=float, default=None, help=argparse.SUPPRESS)   # an HF process's end
    args = parser.parse_args(argv)
    args.name = args.name or ("preemption_model" if args.predict_caps else "long_rollouts")
    if args.predict_caps:
        return predict(args)
    if args.from_json:
        rows = read_rows(args.from_json)
        done = {row_key(r) for r in rows if r.get("tok_per_s")}
        rows = [r for r in rows if r.get("tok_per_s") or row_key(r) not in done]
        save(rows, args.name, args.out)
        return rows
    if any(engine in HF_ENGINES for engine in args.engines) and args.sampler != "greedy":
        parser.error("the HF engines run greedy only")
    if args.engine_process:
        return engine_main(args)
    if args.tiny:
        args.batches, args.prompt_len, args.new_tokens = [2, 3], 8, 40
        args.engines = [e for e in args.engines if e not in VLLM_ENGINES] or ["cb_sync"]
    rows = run_all(args)
    save(rows, args.name, args.out)
    print(table(rows))
    return rows


if __name__ == "__main__":
    sys.exit(exit_code(main()))
