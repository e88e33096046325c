"""Workload L: reasoning-length rollouts. Qwen3-4B shape + LoRA r32, 1,024-token random prompts, 8,192 new tokens
(EOS silenced), batch 8 / 32 / 64, greedy or GRPO's sampler (TRL's defaults: temperature 1, no filter).

    python -m benchmarks.long_rollouts [--batches 8 32 64] [--engines cb_sync_compiled vllm vllm_nolora hf_generate]
        [--sampler greedy|grpo] [--max-cache-gib 96 [16 ...]] [--attn-backend auto|triton|flash|flash_prefill]
        [--name long_rollouts] [--time-limit S]
    python -m benchmarks.long_rollouts --tiny --out DIR      # CPU plumbing check: tiny Qwen3, fp32, a few tokens
    python -m benchmarks.long_rollouts --from-json A.json B.json --name NAME   # merge calls' rows

Each engine runs in a process of its own (benchmarks.isolation), one after the other on the same card. A row is one
engine at one batch size: one timed call after a warm-up call that builds what the timed call uses (for cb_sync: a
request as long as the workload's, prompt 16 tokens short of it, so the decode graphs are captured for the cache's
width; for vLLM: the batch with 16 new tokens). Rows give tok/s of the whole call (prefill included), its seconds,
the floor (weights + adapter + the batch's KV read once a step, at the card's copy bandwidth), peak memory, and for
cb_sync the KV cache it allocated, the preemptions it made and the tokens they had it recompute (`--max-cache-gib`
below the batch's need forces them; several caps: a row for each cap and batch, one driver) and the median time of
a replayed decode step at contexts of 1k / 4k / 8k tokens, and 16k where prompt + new tokens reach it (steps within
64 tokens of each, read to read). vLLM's rows: the card memory its engine holds and the share it reserves.
`hf_generate` and `hf_generate_static` are HF `generate` with the adapter live (dynamic cache; static cache compiled
by `generate` in a first call that stops after 16 tokens, the timed call's cache length, timed apart), greedy, one
timed call a batch, its steps timed too. An HF engine has what is left of `--time-limit` when it starts (the
engines after it get what it leaves); a call still running when that ends stops there, and its row gives the rate
over the tokens it made (`stopped_after_tokens`, in the label and the ratios).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import (RESULTS, build_model, copy_bandwidth, exit_code, floor_seconds_per_step, gpu_state,
                               grouped_bars, markdown_table, write_results)
from benchmarks import throughput
from benchmarks.isolation import run_child
from benchmarks.throughput import make_prompts

CONTEXTS = (1024, 4096, 8192, 16384)     # where a decode step's time is reported
CONTEXT_WINDOW = 64                      # steps within this many tokens of a context count for it
WARMUP_TOKENS = 16
MAX_BATCH_TOKENS = 16384                 # cb_sync's token budget a step: 16 of the 1,024-token prompts
CB_ENGINES = ("cb_sync_compiled", "cb_sync")
HF_ENGINES = ("hf_generate", "hf_generate_static")    # greedy only; static: the cache compiled by `generate`
VLLM_ENGINES = ("vllm", "vllm_nolora")
HF_EXIT_MARGIN_S = 45                    # an HF process stops its call this long before it is stopped
DEFAULT_ENGINES = ("cb_sync_compiled", "vllm", "vllm_nolora")


def step_floor_ms(batch: int, context: int, lora: bool = True) -> float:
    """Bandwidth floor of one decode step (ms): the weights (+ adapter) and the batch's KV at `context` read once."""
    return 1e3 * floor_seconds_per_step(batch, context, lora)


def call_floor_s(batch: int, prompt_len: int, new_tokens: int, lora: bool = True) -> float:
    """The whole call's decode floor: every step's, summed (the KV term grows linearly with the step)."""
    return new_tokens * step_floor_ms(batch, prompt_len + new_tokens / 2, lora) / 1e3


class ContextSteps:
    """A driver observer: for every step, its path, when it was read, the longest context among its requests and
    their KV tokens;
    `ms_at(context)`: the median time of replayed steps near that context (each step's read minus the read before);
    the requests it saw (for their preemptions) and `recomputed`, the tokens fed again below a request's furthest
    position already computed (what preemption cost)."""

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
        self.steps.append((output, max(ends), sum(ends)))                 # the longest context, the KV tokens

    def ms_at(self, context: int) -> float | None:
        times = [1e3 * (out.read_at - prev.read_at) for (prev, *_), (out, ctx, _) in zip(self.steps, self.steps[1:])
                 if out.path == prev.path == "replay" and abs(ctx - context) <= CONTEXT_WINDOW
                 and out.read_at is not None and prev.read_at is not None]
        return round(statistics.median(times), 3) if times else None

    def decode_by_batch(self) -> dict[str, list]:
        """[steps, seconds, mean requests, mean KV tokens] of the pure-decode steps per running batch (1, 2-3, 4-7,
        ...): the mean step at each size, to set against a step clock (one linear in requests and KV tokens predicts
        a bucket's mean step from its means)."""
        buckets = {}
        for (prev, *_), (out, _, kv) in zip(self.steps, self.steps[1:]):
            if out.read_at is None or prev.read_at is None or any(chunk.length != 1 for chunk in out.plan):
                continue
            low = 1 << (len(out.plan).bit_length() - 1)
            totals = buckets.setdefault((low, 2 * low - 1), [0, 0.0, 0, 0])
            for i, value in enumerate((1, out.read_at - prev.read_at, len(out.plan), kv)):
                totals[i] += value
        return {(f"{low}" if low == high else f"{low}-{high}"): [n, round(s, 3), round(r / n, 2), round(kv / n)]
                for (low, high), (n, s, r, kv) in sorted(buckets.items())}

    def preemptions(self) -> int:
        return sum(request.num_preemptions for request in self.requests.values())

    def seconds_by_kind(self) -> dict[str, list]:
        """[steps, seconds] per path and kind of step ("replay decode", "compiled mixed", "eager prefill", ...), each
        step's time read to read: where a call's time went (a capped call's recompute steps among them)."""
        totals = {}
        for (prev, *_), (out, *_) in zip(self.steps, self.steps[1:]):
            if out.read_at is not None and prev.read_at is not None:
                decodes = sum(chunk.length == 1 for chunk in out.plan)
                kind = "decode" if decodes == len(out.plan) else "prefill" if not decodes else "mixed"
                count, seconds = totals.get(f"{out.path} {kind}", (0, 0.0))
                totals[f"{out.path} {kind}"] = (count + 1, seconds + out.read_at - prev.read_at)
        return {key: [count, round(seconds, 2)] for key, (count, seconds) in sorted(totals.items())}


def sampling_params(sampler: str, new_tokens: int):
    from cb_sync import SamplingParams
    return SamplingParams(max_new_tokens=new_tokens, do_sample=sampler == "grpo", temperature=1.0, eos_token_id=[])


def run_cb_sync(engine: str, model, prompts: dict, args, on_row) -> list[dict]:
    """One driver serves every cap and batch (one compile, graphs captured once for the cache's width); between two
    caps the cache is released (the graphs kept) and the next call allocates it within the new cap."""
    from cb_sync import CBConfig, SyncCBDriver
    steps = ContextSteps()
    driver = SyncCBDriver(model, CBConfig(max_batch_size=max(args.batches), max_batch_tokens=MAX_BATCH_TOKENS,
                                          compile=engine == "cb_sync_compiled", max_cache_gib=args.max_cache_gib[0],
                                          attn_backend=args.attn_backend, progress_bar=False), observer=steps)
    length = args.prompt_len + args.new_tokens
    start = time.perf_counter()
    driver.generate([prompts[min(prompts)][0][:1] * (length - WARMUP_TOKENS)],
                    sampling_params(args.sampler, WARMUP_TOKENS), seed=0)
    warmup_s = time.perf_counter() - start
    rows = []
    for cap, batch in ((cap, batch) for cap in args.max_cache_gib for batch in args.batches):
        if cap != driver.config.max_cache_gib:
            driver.release(keep_graphs=True)
            driver.config = dataclasses.replace(driver.config, max_cache_gib=cap)
        steps.clear()
        gc.collect()
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        results = driver.generate(prompts[batch], sampling_params(args.sampler, args.new_tokens), seed=0)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        lengths = {len(r.token_ids) for r in results}
        if len(results) != batch or lengths != {args.new_tokens}:
            raise RuntimeError(f"batch {batch}: expected {batch} completions of {args.new_tokens} tokens, got "
                               f"{len(results)} of lengths {sorted(lengths)}")
        row = _row(engine, batch, args, seconds, torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
        row.update(attn_backend=args.attn_backend, warmup_s=round(warmup_s, 1),
                   kv_gib=round(driver.cache.nbytes / 2**30, 2), preemptions=steps.preemptions(),
                   recomputed_tokens=steps.recomputed, max_cache_gib=cap,
                   seconds_by_kind=steps.seconds_by_kind(), decode_by_batch=steps.decode_by_batch(),
                   **{f"ms_step_{c}": steps.ms_at(c) for c in CONTEXTS if c <= length},
                   **{f"floor_ms_{c}": round(step_floor_ms(batch, c), 3) for c in CONTEXTS if c <= length},
                   **gpu_state())
        rows.append(row)
        print(row, flush=True)
        on_row(rows)
    driver.release()
    return rows


def _identity(engine: str, batch: int, args) -> dict:
    """What every row of an engine at a batch says, measured or not: the engine, the adapter, the workload."""
    return {"engine": engine, "batch": batch, "lora": engine != "vllm_nolora", "sampler": args.sampler,
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}


def _row(engine: str, batch: int, args, seconds: float, peak_gib: float, made: int | None = None) -> dict:
    """A measured row; made: the new tokens a row of the call made where it stopped short of the workload's."""
    made, identity = args.new_tokens if made is None else made, _identity(engine, batch, args)
    floor = call_floor_s(batch, args.prompt_len, made, identity["lora"])
    return {**identity, "model": "qwen3-tiny" if args.tiny else "qwen3-4b-shape",
            "tok_per_s": round(batch * made / seconds, 1), "seconds": round(seconds, 2),
            "peak_gib": round(peak_gib, 2), "pct_of_floor": None if args.tiny else round(100 * floor / seconds, 1),
            **({"stopped_after_tokens": made} if made < args.new_tokens else {})}


def run_hf_generate(engine: str, model, prompts: dict, args, on_row) -> list[dict]:
    """HF `generate` with the adapter live, greedy, its steps timed (`throughput.HFStepClock`). With --stop-at (from
    run_all: the end of what is left of --time-limit, less HF_EXIT_MARGIN_S) a call still running then stops there:
    its row counts the tokens made (`stopped_after_tokens`), and a batch not started by then is a row saying so; a
    batch that fails (out of memory) is a row with its error."""
    deadline = None if args.stop_at is None else time.monotonic() + args.stop_at - time.time()
    length, rows = args.prompt_len + args.new_tokens, []
    for batch in args.batches:
        failed = _identity(engine, batch, args)
        if deadline is not None and time.monotonic() >= deadline:
            rows.append({**failed, "error": "not run: --time-limit used up"})
            continue
        clock = throughput.HFStepClock(deadline)
        try:
            seconds, peak, extra = throughput.run_hf_generate(model, prompts[batch], args.new_tokens,
                                                              static=engine == "hf_generate_static",
                                                              warmup_tokens=WARMUP_TOKENS, clock=clock)
            made = max(clock.ends) - args.prompt_len
            rows.append({**_row(engine, batch, args, seconds, peak, made), **extra,
                         **{f"ms_step_{c}": clock.ms_at(c, CONTEXT_WINDOW) for c in CONTEXTS if c <= length},
                         **gpu_state()})
        except Exception as error:
            rows.append({**failed, "error": f"{error!r}"[:500]})
        print(rows[-1], flush=True)
        on_row(rows)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def _engine_main(args) -> None:
    """One cb_sync or HF engine in this process: its rows to <out>/<name>.json after each batch."""
    copy_bandwidth()            # the floors' bandwidth: a card not in COPY_BANDWIDTHS is measured before it fills up
    if args.tiny:
        model = build_model(lora=True, tiny=True, device="cpu", dtype=torch.float32)
    else:
        model = build_model(lora=True)
    prompts = make_prompts(model.config.vocab_size, args.batches, args.prompt_len)
    save = lambda rows: write_results(args.name, rows, table(rows), args.out)   # noqa: E731
    engine = args.engines[0]
    save((run_hf_generate if engine in HF_ENGINES else run_cb_sync)(engine, model, prompts, args, save))


def _engine_command(engine: str, args, name: str, stop_at: float | None) -> list[str]:
    """The engine's process; an HF engine stops its calls HF_EXIT_MARGIN_S before `stop_at` (time.time()), when the
    process will be stopped, so that it writes its rows first."""
    shared = ["--name", name, "--out", str(args.out), "--batches", *map(str, args.batches), "--prompt-len",
              str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--sampler", args.sampler,
              *(["--tiny"] if args.tiny else [])]
    if engine in VLLM_ENGINES:
        return [sys.executable, "-m", "benchmarks.peers_vllm", "--engine", engine, *shared, "--repeats", "1",
                "--warmup-tokens", str(WARMUP_TOKENS), "--max-model-len", str(args.prompt_len + args.new_tokens)]
    if engine in HF_ENGINES and stop_at is not None:
        shared += ["--stop-at", f"{stop_at - HF_EXIT_MARGIN_S:.1f}"]
    return [sys.executable, "-m", "benchmarks.long_rollouts", "--engines", engine, "--engine-process", *shared,
            "--max-cache-gib", *map(str, args.max_cache_gib), "--attn-backend", args.attn_backend]


def run_all(args) -> list[dict]:
    """Every engine in a process of its own, cb_sync first; a row an engine did not write carries the reason."""
    stop = None if args.time_limit is None else time.monotonic() + args.time_limit
    rows = []
    for engine in sorted(args.engines, key=lambda e: e in VLLM_ENGINES):
        name = f"{args.name}_{engine}"
        left = None if stop is None else stop - time.monotonic()
        cb = engine in CB_ENGINES
        expected = [{**_identity(engine, b, args),
                     **({"max_cache_gib": cap, "attn_backend": args.attn_backend} if cb else {})}
                    for cap in (args.max_cache_gib if cb else [None]) for b in args.batches]
        if left is not None and left <= 0:
            rows += [{**row, "error": "not run: --time-limit used up"} for row in expected]
            continue
        outcome = run_child(_engine_command(engine, args, name, None if left is None else time.time() + left),
                            timeout=left)
        path = args.out / f"{name}.json"
        got = json.loads(path.read_text()) if path.is_file() else []
        have = {_key(row) for row in got}
        rows += got + [{**row, "error": outcome.reason(left)} for row in expected if _key(row) not in have]
        for suffix in (".json", ".md"):
            (args.out / f"{name}{suffix}").unlink(missing_ok=True)
        write_results(args.name, rows, table(rows), args.out)
    plot([row for row in rows if row.get("tok_per_s")], args.out / f"{args.name}.png")
    print(table(rows))
    return rows


def merge(paths: list[str], name: str, out: Path) -> list[dict]:
    rows = [row for path in paths for row in json.loads(Path(path).read_text())]
    measured = {_key(r) for r in rows if r.get("tok_per_s")}
    rows = [r for r in rows if r.get("tok_per_s") or _key(r) not in measured]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1))
    (out / f"{name}.md").write_text(table(rows))
    plot([row for row in rows if row.get("tok_per_s")], out / f"{name}.png")
    print(table(rows))
    return rows


def _key(row: dict) -> tuple:
    """What a row measured: engine, workload (batch, sampler, lengths) and, for cb_sync, its KV cap and attention
    backend."""
    return (row["engine"], *_workload(row), row.get("max_cache_gib"), _backend(row))


def _workload(row: dict) -> tuple:
    return row["batch"], row.get("sampler"), row.get("prompt_len"), row.get("new_tokens")


def _backend(row: dict) -> str | None:
    """cb_sync's attention backend in a row (rows from before it was recorded ran "auto"); None for the peers."""
    return row.get("attn_backend", "auto") if row["engine"] in CB_ENGINES else None


def _label(row: dict) -> str:
    backend = _backend(row)
    engine = row["engine"] if backend in ("auto", None) else f"{row['engine']} {backend}"
    if row.get("max_cache_gib") is not None:
        return f"{engine} (cap {row['max_cache_gib']:g} GiB)"
    return engine if row["engine"] != "vllm_nolora" else "vllm_nolora (merged weights)"


def _card(row: dict) -> str:
    """The card a row ran on (rows from before cards were recorded ran on the H200)."""
    return row.get("gpu", "NVIDIA H200")


def table(rows: list[dict]) -> str:
    """One line per row, with cb_sync's ratio to every peer row of its workload measured on the same card (calls
    merged with --from-json may come from several machines: compare within one)."""
    peers = [r for r in rows if r.get("tok_per_s") and r["engine"] in (*VLLM_ENGINES, *HF_ENGINES)]
    lines = []
    for row in rows:
        if not row.get("tok_per_s"):
            lines.append([_label(row), row.get("sampler", "-"), row["batch"], *["-"] * 9,
                          f"could not run: {row.get('error', 'no result')}"])
            continue
        ratios = [f"{row['tok_per_s'] / p['tok_per_s']:.2f}x {p['engine']}{_stopped(p)}" for p in peers
                  if row["engine"] in CB_ENGINES and _workload(p) == _workload(row) and _card(p) == _card(row)]
        steps = " / ".join(_cell(row, f"ms_step_{c}") for c in CONTEXTS)
        floors = " / ".join(_cell(row, f"floor_ms_{c}") for c in CONTEXTS)
        memory = row["peak_gib"] if row.get("card_held_gib") is None else (
            f"{row['card_held_gib']} held / {row['card_reserved_gib']} reserved")
        of_floor = f"{row['pct_of_floor']}%" if row.get("pct_of_floor") is not None else "-"
        lines.append([_label(row) + _stopped(row), row.get("sampler", "-"), row["batch"], row["tok_per_s"],
                      row["seconds"], of_floor, steps, floors, memory, row.get("kv_gib", "-"), _preemptions(row),
                      row.get("engine_start_s", row.get("warmup_s", "-")), ", ".join(ratios) or "-"])
    headers = ["engine", "sampler", "batch", "tok/s", "s", "of floor", "ms/step at 1k / 4k / 8k / 16k",
               "floor ms at 1k / 4k / 8k / 16k", "peak GiB", "KV GiB", "preemptions (tokens recomputed)",
               "engine start (cb_sync: warm-up) s", "vs peers (same card)"]
    return f"{caption(rows)}\n\n{markdown_table(headers, lines)}"


def _cell(row: dict, key: str) -> str:
    """A row's value, "-" where the call never reached it (a context below the prompt or past the completion)."""
    return "-" if row.get(key) is None else str(row[key])


def _stopped(row: dict) -> str:
    made = row.get("stopped_after_tokens")
    return "" if made is None else f" (its first {made:,} tokens: stopped at the time limit)"


def _preemptions(row: dict) -> str:
    if "preemptions" not in row:
        return "-"
    return f"{row['preemptions']} ({row['recomputed_tokens']:,})" if "recomputed_tokens" in row else str(
        row["preemptions"])


def plot(rows: list[dict], path: Path) -> None:
    """Tok/s per engine (cb_sync: and KV cap) and batch; skipped without matplotlib."""
    rows = sorted(rows, key=lambda r: (r["engine"] in VLLM_ENGINES, r["engine"], -(r.get("max_cache_gib") or 0)))
    grouped_bars({_label(row): {r["batch"]: r["tok_per_s"] for r in rows if _label(r) == _label(row)}
                  for row in rows}, path, caption(rows), width_inches=9)


def caption(rows: list[dict]) -> str:
    """The workloads and cards of `rows`, in words."""
    lengths = " or ".join(sorted({f"{r.get('prompt_len', 1024):,}-token prompts, {r.get('new_tokens', 8192):,} new "
                                  "tokens" for r in rows}))
    return f"Workload L (Qwen3-4B shape + LoRA r32, {lengths}), {' and '.join(sorted({_card(r) for r in rows}))}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--engines", nargs="+", default=list(DEFAULT_ENGINES),
                        choices=[*CB_ENGINES, *HF_ENGINES, *VLLM_ENGINES])
    parser.add_argument("--sampler", choices=["greedy", "grpo"], default="greedy")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=8192)
    parser.add_argument("--max-cache-gib", type=float, nargs="+", default=[96.0],
                        help="cb_sync's KV caps (CBConfig.max_cache_gib): a row for each cap and batch")
    parser.add_argument("--attn-backend", default="auto", choices=["auto", "triton", "flash", "flash_prefill"],
                        help="cb_sync's CBConfig.attn_backend")
    parser.add_argument("--name", default="long_rollouts")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--time-limit", type=float, default=None, help="seconds for all engines together")
    parser.add_argument("--tiny", action="store_true", help="CPU plumbing: tiny Qwen3, batches 2 and 3, 8 + 40 tokens")
    parser.add_argument("--from-json", nargs="+", default=None, metavar="FILE",
                        help="measure nothing: <out>/<name>.json|md|png from the rows of FILEs (each card's rows "
                             "compared among themselves); rows with an error for a batch that another file measured "
                             "are dropped")
    parser.add_argument("--engine-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stop-at", type=float, default=None, help=argparse.SUPPRESS)   # an HF process's end
    args = parser.parse_args(argv)
    if args.from_json:
        return merge(args.from_json, args.name, args.out)
    if any(engine in HF_ENGINES for engine in args.engines) and args.sampler != "greedy":
        parser.error("the HF engines run greedy only")
    if args.tiny and not args.engine_process:
        args.batches, args.prompt_len, args.new_tokens = [2, 3], 8, 40
        args.engines = [e for e in args.engines if e not in VLLM_ENGINES] or ["cb_sync"]
    if args.engine_process:
        return _engine_main(args)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(exit_code(main()))
