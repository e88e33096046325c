"""Workloads G and G2 measured and judged: per-step statistics (a TrainerCallback), the equivalence gate between
backends, and the report (<name>.md tables, <name>.png).

The gate takes a backend as training "the same thing" as the reference (TRL's plain `generate` path) when its
losses are finite, its rewards lie in the reward functions' range, it learnt (some step with reward_std and
grad_norm > 0) and trained at all (not loss and grad norm 0 on every step, as when TRL's importance-sampling
correction masks every sequence), and its per-step KL stays within `kl_tol + kl_rtol * |KL_ref|` of the reference's.
Backends draw different samples, so only these coarse properties are compared, never exact values.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from benchmarks.harness import markdown_table, pyplot, since_process_start

REFERENCE = "trl_generate"
GC_PAUSE_LIMIT_S = 0.1      # no step should carry a run of the garbage collector longer than this
LOGGED = {  # row key -> key in TRL's logs
    "loss": "loss", "reward": "reward", "reward_std": "reward_std", "kl": "kl", "grad_norm": "grad_norm",
    "entropy": "entropy", "completion_len": "completions/mean_length", "clipped_ratio": "completions/clipped_ratio",
    **{f"logp_gap_{k}": f"sampling/sampling_logp_difference/{k}" for k in ("mean", "max", "p95")},
    **{f"is_ratio_{k}": f"sampling/importance_sampling_ratio/{k}" for k in ("min", "mean", "max")},
    "ratio_outside": "sampling/ratio_outside_0.9_1.1",
}


class GRPOStats(TrainerCallback):
    """A row an optimizer step in `rows`: wall time (the device synchronised), rollout time (`timed` wraps TRL's
    `_generate`), every completion's length (`counted`), torch's peak memory (reset each step), the card's memory in
    use (every process and pool: vLLM's are not in torch's counters; sampled after each rollout, each call wrapped
    with `sampled` and at the step's end), when the step ended (`at_s`, seconds since the process started), the
    garbage collector's runs in the step (`gc_s`, `gc_max_s`, `gc_runs`) and between it and the step before
    (`gc_between_s`, `gc_between_max_s`), read from `pauses` (harness.gc_pauses' list, set while training), and
    what TRL logs. It fingerprints the trainable weights at train begin
    (runs can show they started alike) and, given a `deadline` (perf_counter), stops after the step whose successor
    would end past it, once `min_steps` are done. `write()` dumps {"backend", **extra, "steps": rows} to `path`."""

    def __init__(self, backend: str, path: Path | None = None, verbose: bool = True, deadline: float | None = None,
                 min_steps: int = 2, cuda: bool | None = None):
        self.backend, self.path, self.verbose = backend, path, verbose
        self.deadline, self.min_steps = deadline, min_steps
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.stopped_early = False
        self.extra: dict = {}
        self.rows: list[dict] = []
        self.init_fingerprint: dict | None = None
        self._t0 = self._gen_s = 0.0
        self._card = self._lens = None
        self.pauses: list[tuple[float, float]] = []
        self._ended = self._began = 0       # pauses seen at the last step's end, at this step's begin

    def timed(self, fn):
        def wrapper(*args, **kwargs):
            self._sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self._gen_s += time.perf_counter() - start
                self.sample_card()
        return wrapper

    def counted(self, fn):
        """Wrap TRL's `_generate` (completion ids second in what it returns)."""
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            self._lens = (self._lens or []) + [len(ids) for ids in out[1]]
            return out
        return wrapper

    def sampled(self, fn):
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            finally:
                self.sample_card()
        return wrapper

    def sample_card(self) -> float | None:
        if not self.cuda:
            return None
        free, total = torch.cuda.mem_get_info()
        used = (total - free) / 2**30
        self._card = used if self._card is None else max(self._card, used)
        return used

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            self.init_fingerprint = fingerprint(model)

    def on_step_begin(self, args, state, control, **kwargs):
        self._sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self._gen_s, self._card, self._lens = 0.0, None, None
        self._began = len(self.pauses)
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        step_s = time.perf_counter() - self._t0
        end = self.sample_card()
        self.rows.append({"step": state.global_step, "step_s": step_s, "gen_s": self._gen_s,
                          "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None,
                          "card_gib": self._card, "card_end_gib": end, "at_s": since_process_start(),
                          **gc_fields(self.pauses[self._began:]),
                          **gc_fields(self.pauses[self._ended:self._began], "gc_between")})
        self._ended = len(self.pauses)
        if self._lens is not None:
            self.rows[-1]["completion_lens"] = self._lens
        if (self.deadline is not None and len(self.rows) >= self.min_steps and state.global_step < state.max_steps
                and time.perf_counter() + step_s > self.deadline):
            control.should_training_stop = True
            self.stopped_early = self.extra["stopped_early"] = True
            print(f"[{self.backend}] time share used up: stopping after step {state.global_step}", flush=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not self.rows or self.rows[-1]["step"] != state.global_step:
            return
        row = self.rows[-1]
        fresh = "loss" in logs and "loss" not in row
        row.update({key: float(logs[name]) for key, name in LOGGED.items() if logs.get(name) is not None})
        if fresh:
            if self.verbose:
                print(f"[{self.backend}] " + ", ".join(f"{k} {_fmt(v)}" for k, v in row.items()
                                                       if k in ("step", "step_s", "gen_s", "card_gib", "loss", "kl",
                                                                "logp_gap_mean")), flush=True)
            if self.path is not None:
                self.write()

    def write(self, path: Path | None = None) -> None:
        Path(path or self.path).write_text(json.dumps({"backend": self.backend, **self.extra, "steps": self.rows},
                                                      indent=1))


def gc_fields(pauses: list[tuple[float, float]], prefix: str = "gc") -> dict:
    seconds = [s for _, s in pauses]
    fields = {f"{prefix}_s": sum(seconds), f"{prefix}_max_s": max(seconds, default=0.0)}
    return fields if prefix != "gc" else {**fields, "gc_runs": len(seconds)}


def soak_fields(steps: list[dict], warmup: int, window: int) -> dict:
    """How a run held up. `drift`: the first `window` timed steps against the last `window` (at most half the timed
    steps each): median step ms, and the largest of torch's peak and of the card's memory in each. The garbage
    collector: its longest run inside a step (every step, and the timed ones), the steps with a run over
    GC_PAUSE_LIMIT_S, and its longest run between steps (where the trainer may collect on purpose)."""
    timed = steps[warmup:] or steps
    n, fields = min(window, len(timed) // 2), {}
    if n:
        def largest(part, key):
            values = [s[key] for s in part if s.get(key) is not None]
            return round(max(values), 2) if values else None
        ends = (timed[:n], timed[-n:])
        fields["drift"] = {"window": n, "step_ms": [round(1000 * statistics.median(s["step_s"] for s in part), 1)
                                                    for part in ends],
                           **{key: [largest(part, key) for part in ends] for key in ("peak_gib", "card_gib")}}
    if steps and all("gc_max_s" in s for s in steps):
        ms = lambda part, key: round(1000 * max(s[key] for s in part), 1)   # noqa: E731
        fields.update(gc_max_ms=ms(steps, "gc_max_s"), gc_max_ms_timed=ms(timed, "gc_max_s"),
                      gc_between_max_ms=ms(steps, "gc_between_max_s"),
                      gc_steps_over_limit=[s["step"] for s in steps if s["gc_max_s"] > GC_PAUSE_LIMIT_S])
    return fields


def fingerprint(model) -> dict:
    """Count, sum and abs-sum (float64) of the trainable parameters: equal across runs that start from equal weights."""
    params = [p.detach() for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        total = sum(float(p.sum(dtype=torch.float64)) for p in params)
        absolute = sum(float(p.abs().sum(dtype=torch.float64)) for p in params)
    return {"trainable_numel": sum(p.numel() for p in params), "sum": total, "abs_sum": absolute}


# -- the gate -----------------------------------------------------------------------------------------------------

def _finite(x) -> bool:
    return x is not None and math.isfinite(x)


def trained_check(rows: list[dict]) -> dict:
    """Fails when every step logged loss 0 and grad_norm 0; masked_by_is: TRL's IS ratios were 0 on those steps."""
    idle = [r for r in rows if r.get("loss") == 0 and r.get("grad_norm") == 0]
    masked = bool(idle) and all(r.get("is_ratio_max") == 0 for r in idle)
    return {"pass": bool(rows) and len(idle) < len(rows), "idle_steps": len(idle), "steps": len(rows),
            "masked_by_is": masked}


def compare(reference_rows: list[dict], other_rows: list[dict], kl_tol: float, *,
            reward_range: tuple[float, float] | None = None, kl_rtol: float = 0.0,
            logp_gap_tol: float | None = None, expected_steps: int | None = None) -> dict:
    """The gate of `other_rows` against `reference_rows` (GRPOStats rows): {"pass", "checks"}, each check
    {"pass": True / False / None (not checkable), ...}: steps (expected_steps, default the reference's),
    losses_finite, signal, trained, rewards_in_range, kl_close, and logp_gap (cb_sync's largest per-step max gap
    between generator and trainer logprobs; gated at logp_gap_tol, else reported)."""
    checks: dict[str, dict] = {}
    expected = len(reference_rows) if expected_steps is None else expected_steps
    checks["steps"] = {"pass": len(other_rows) == expected and len(other_rows) > 0, "expected": expected,
                       "other": len(other_rows)}
    losses = [r.get("loss") for r in other_rows]
    grads = [r.get("grad_norm") for r in other_rows if "grad_norm" in r]
    checks["losses_finite"] = {"pass": bool(losses) and all(map(_finite, losses + grads)), "losses": losses}
    learning = [r for r in other_rows if (r.get("reward_std") or 0) > 0 and (r.get("grad_norm") or 0) > 0]
    checks["signal"] = {"pass": bool(learning), "steps_with_signal": len(learning)}
    checks["trained"] = trained_check(other_rows)
    rewards = [r.get("reward") for r in other_rows]
    if reward_range is None:
        checks["rewards_in_range"] = {"pass": None, "rewards": rewards}
    else:
        lo, hi = reward_range
        checks["rewards_in_range"] = {"pass": bool(rewards) and all(_finite(x) and lo <= x <= hi for x in rewards),
                                      "range": [lo, hi], "rewards": rewards}
    ref_kl = {r["step"]: r.get("kl") for r in reference_rows}
    pairs = [(ref_kl.get(r["step"]), r.get("kl")) for r in other_rows]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    if not pairs:
        checks["kl_close"] = {"pass": None, "reason": "KL not logged by both runs (beta = 0?)"}
    else:
        diffs = [abs(b - a) for a, b in pairs]
        checks["kl_close"] = {"pass": all(_finite(d) and d <= kl_tol + kl_rtol * abs(a) for d, (a, _) in
                                          zip(diffs, pairs)),
                              "kl_tol": kl_tol, "kl_rtol": kl_rtol, "max_abs_diff": max(diffs),
                              "mean_reference": sum(a for a, _ in pairs) / len(pairs),
                              "mean_other": sum(b for _, b in pairs) / len(pairs)}
    gaps = [r["logp_gap_max"] for r in other_rows if r.get("logp_gap_max") is not None]
    if gaps:
        worst = max(gaps)
        checks["logp_gap"] = {"pass": None if logp_gap_tol is None else _finite(worst) and worst <= logp_gap_tol,
                              "tol": logp_gap_tol, "max": worst}
    return {"pass": all(c["pass"] for c in checks.values() if c["pass"] is not None), "checks": checks}


def _describe(name: str, check: dict) -> str:
    verdict = "n/a" if check["pass"] is None else "pass" if check["pass"] else "FAIL"
    extra = ""
    if name == "kl_close" and "max_abs_diff" in check:
        extra = (f" (max |dKL| {check['max_abs_diff']:.3g}, allowed {check['kl_tol']:g} + {check['kl_rtol']:g} x "
                 f"|KL_ref|; mean KL {check['mean_other']:.3g} vs {check['mean_reference']:.3g})")
    elif name == "rewards_in_range" and "range" in check:
        found = [x for x in check["rewards"] if x is not None]
        extra = f" (rewards {min(found):.3g}..{max(found):.3g} in {check['range']})" if found else ""
    elif name == "logp_gap":
        extra = f" (max {check['max']:.3g}, {'report only' if check['tol'] is None else 'tol %g' % check['tol']})"
    elif name == "trained":
        extra = f" (loss and grad norm 0 on {check['idle_steps']} of {check['steps']} steps"
        if check["pass"] is False:
            extra += ": trained nothing" + ("; IS ratio max 0 on every step: the importance-sampling correction "
                                            "masked every sequence" if check["masked_by_is"] else "")
        extra += ")"
    elif name == "steps":
        extra = f" ({check['other']} of {check['expected']})"
    return f"{name} {verdict}{extra}"


def gate_lines(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        gate, against = (r["gate"], REFERENCE) if r.get("gate") else (r.get("gate_self"), "itself")
        if gate is not None:
            lines.append(f"- {r['engine']} vs {against}: **{_verdict(gate)}**; "
                         + "; ".join(_describe(n, c) for n, c in gate["checks"].items()))
    return lines


# -- the report ---------------------------------------------------------------------------------------------------

def _fmt(x, digits=4):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if math.isfinite(x) else str(x)
    return str(x)


def _verdict(gate: dict | None) -> str:
    return "-" if gate is None else "pass" if gate["pass"] else "FAIL"


def _gap(r: dict) -> str:
    """Generator-vs-trainer logprob gap (mean / (p95 /) max, cb_sync: the share of ratios outside [0.9, 1.1]) and
    TRL's importance-sampling ratio (mean, min)."""
    parts = []
    if r.get("logp_gap_p95") is not None:
        parts.append(f"{_fmt(r['logp_gap_mean'], 3)} / {_fmt(r['logp_gap_p95'], 3)} / {_fmt(r['logp_gap_max'], 3)}, "
                     f"{100 * (r.get('ratio_outside') or 0):.1f}% outside [0.9, 1.1]")
    elif r.get("logp_gap_mean") is not None:
        parts.append(f"{_fmt(r['logp_gap_mean'], 3)} / {_fmt(r['logp_gap_max'], 3)}")
    if r.get("is_ratio_mean") is not None:
        parts.append(f"IS {_fmt(r['is_ratio_mean'], 3)} (min {_fmt(r['is_ratio_min'], 3)})")
    return "; ".join(parts) or "-"


def summary_table(rows: list[dict]) -> str:
    """A line a backend; ratios: peer / cb_sync for time, cb_sync / peer for memory (the card's where both have it,
    else torch's peak), this run's rows only."""
    cb = next((r for r in rows if r["engine"].startswith("cb_sync") and r.get("step_ms") is not None), None)
    out = []
    for r in rows:
        note = r.get("skipped") or (f"error: {r['error'][:300]}" if r.get("error") else "")
        if r.get("step_ms") is None:
            out.append([r["engine"], *["-"] * 10, note or "no step finished"])
            continue
        ratios = "-"
        if cb is not None and r is not cb:
            key = next((k for k in ("card_gib", "peak_gib") if cb.get(k) and r.get(k)), None)
            memory = f"{cb[key] / r[key]:.2f}x {key[:4]}" if key else "-"
            ratios = f"{r['step_ms'] / cb['step_ms']:.2f}x / {r['gen_ms'] / cb['gen_ms']:.2f}x / {memory}"
        gate = r.get("gate") or r.get("gate_self")
        verdict = f"reference ({_verdict(gate)})" if r["engine"] == REFERENCE else _verdict(gate)
        trained = (gate or {}).get("checks", {}).get("trained")
        if trained is not None and trained["pass"] is False:
            verdict += " (trained nothing" + (": IS correction masked every sequence)" if trained["masked_by_is"]
                                              else ")")
        steps = f"{len(r['per_step'])}/{r['steps']}" + (" (time limit)" if r.get("stopped_early") else "")
        alone = "-" if r.get("driver_alone_s") is None else (
            f"{1000 * r['driver_alone_s']:.1f} ({_fmt(r.get('rollout_vs_driver'), 3)}x)")
        out.append([_name(r), steps, r["step_ms"], r["gen_ms"], _fmt(r.get("rollout_tok_s")), alone,
                    _fmt(r["peak_gib"]), _fmt(r.get("card_gib")), _fmt(r["mean_completion_len"]), _gap(r), verdict,
                    ratios + (f" ({note})" if note else "")])
    return markdown_table(["backend", "steps", "median step ms", "median rollout ms", "rollout tok/s",
                           "driver alone ms (rollout / driver)", "peak GiB (torch)", "card GiB in use (max)",
                           "completion len", "logprob gap mean / (p95 /) max; IS ratio", "gate",
                           "peer/cb_sync: step / rollout time; cb_sync/peer: memory"], out)


def soak_table(rows: list[dict]) -> str:
    """A line a backend that ran: time to its first step, drift from its first to its last timed steps, and the
    garbage collector's longest runs."""
    out = []
    for r in rows:
        if not r.get("per_step"):
            continue
        drift = r.get("drift") or {}
        first = "-" if r.get("first_step_s") is None else f"{r['first_step_s']:.1f} (from {r['first_step_from']})"
        over = r.get("gc_steps_over_limit")
        out.append([_name(r), first, drift.get("window", "-"),
                    *(" -> ".join(map(_fmt, drift[key])) if drift else "-" for key in ("step_ms", "peak_gib",
                                                                                       "card_gib")),
                    f"{_fmt(r.get('gc_max_ms'))} / {_fmt(r.get('gc_max_ms_timed'))}",
                    "-" if over is None else ", ".join(map(str, over)) or "none", _fmt(r.get("gc_between_max_ms"))])
    return markdown_table(["backend", "first step s", "window (steps)", "median step ms, first -> last window",
                           "peak GiB (torch)", "card GiB in use", "longest GC run in a step ms (all / timed)",
                           f"steps with a GC run > {1000 * GC_PAUSE_LIMIT_S:.0f} ms",
                           "longest GC run between steps ms"], out)


def _name(r: dict) -> str:
    return r["engine"] + (f" ({r['ranks']} ranks)" if "ranks" in r else "") + (
        " (second run, compile caches warm)" if r.get("compile_caches") == "warm" else "")


def step_table(per_step: list[dict]) -> str:
    keys = ["step", "step_s", "gen_s", "peak_gib", "card_gib", "loss", "reward", "reward_std", "kl", "grad_norm",
            "completion_len", "logp_gap_mean", "logp_gap_max", "is_ratio_mean", "forward_tokens", "gc_max_s", "at_s"]
    cells = [[_fmt(r.get(k)) for k in keys] for r in per_step]
    if any("completion_lens" in r for r in per_step):       # EOS live: what each rollout generated
        keys = keys + ["completion_tokens", "len_max"]
        for row, r in zip(cells, per_step):
            lens = r.get("completion_lens") or []
            row += [sum(lens), max(lens, default="-")]
    return markdown_table(keys, cells)


def report(rows: list[dict], title: str, settings: str) -> str:
    """<name>.md: what a step does, the summary, completion lengths, the gate, each backend's steps."""
    text = [title, "", settings, "", "## Summary", "", summary_table(rows)]
    if any(r.get("per_step") for r in rows):
        text += ["## Time to first step, drift and garbage-collection pauses", "", soak_table(rows)]
    ran = [r for r in rows if r.get("len_mean") is not None]
    if ran:
        text += ["## Completion lengths (every rollout)", "", markdown_table(
            ["backend", "completions", "mean", "p50", "p90", "max"],
            [[r["engine"], r["len_count"], r["len_mean"], r["len_p50"], r["len_p90"], r["len_max"]] for r in ran])]
    text += ["## Equivalence gate", "", *(gate_lines(rows) or ["- no backend finished a step"]), ""]
    for r in rows:
        if r.get("per_step"):
            text += [f"## {r['engine']} per step (built in {r.get('build_s', '-')} s)", "", step_table(r["per_step"])]
        if r.get("weight_sync"):
            text += [f"## {r['engine']}: does TRL's weight sync reach vLLM?", "", weight_sync_line(r["weight_sync"]),
                     ""]
    return "\n".join(text)


SYNC_VERDICTS = {True: "the sync reaches vLLM", False: "the sync does NOT reach vLLM",
                 None: "cannot tell (the LoRA update is below the weights' resolution everywhere)"}


def weight_sync_line(check: dict) -> str:
    if "error" in check:
        return f"Not checked: {check['error']}"
    return (f"After the last step TRL's sync pushed the weights into vLLM once more: `{check['name']}` in vLLM then "
            f"differed from the trainer's merged weight in {check['mismatch_vs_trainer']} of {check['numel']} "
            f"elements and from the checkpoint vLLM started from in {check['changed_vs_start']} "
            f"({check['expected_changed']} had to change). Verdict: {SYNC_VERDICTS[check['reaches']]}.")


def plot(rows: list[dict], path: Path) -> None:
    """Step time, peak memory and KL per step, a line a backend."""
    ran, plt = [r for r in rows if r.get("per_step")], pyplot()
    if not ran or plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (key, title) in zip(axes, [("step_s", "step time (s)"), ("peak_gib", "peak GPU memory (GiB)"),
                                       ("kl", "KL to the reference model")]):
        for r in ran:
            points = [(s["step"], s[key]) for s in r["per_step"] if s.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=r["engine"])
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
