"""Per-step statistics of a GRPO run (a `TrainerCallback`) and the equivalence gate between backends.

`GRPOStats` records, for each optimizer step: wall time (step begin -> step end, the GPU synchronised), time spent in
rollout generation (when the trainer's `_generate` is wrapped with `stats.timed`), the length of every completion
(`completion_lens`, when it is wrapped with `stats.counted`), the main thread's CPU seconds, the Triton kernels
compiled during the step (`triton_compiles`, by name), the garbage collector's pauses (`gc_s`), the caching
allocator's retries, cudaMalloc and cudaFree calls (`alloc_retries`, `device_allocs`, `device_frees`), peak GPU
memory (torch's counters,
reset at each step begin; None when `cuda=False`), the card's memory in use (every process and pool on the device,
sampled at the step's end, after each timed rollout and after each call wrapped with `stats.sampled`: vLLM's pool is
not in torch's counters), and what TRL logs for the step: loss, reward, reward_std, KL, grad_norm, completion
length, the generator-vs-trainer logprob gap `sampling/sampling_logp_difference/{mean,max}` (cb_sync, TRL + vLLM)
and TRL's importance-sampling ratios `sampling/importance_sampling_ratio/{min,mean,max}` (TRL + vLLM). It also
fingerprints the trainable weights at train begin, so runs can show they started from the same weights.

With a `deadline` (a time.perf_counter() value) it stops training after the step whose successor would likely end
past the deadline, once `min_steps` steps are done, and sets `stopped_early`.

`compare(reference_rows, other_rows, kl_tol)` is the gate: a backend is taken as training "the same thing" as the
reference (TRL's plain generate path) when its losses are finite, its rewards lie in the reward functions' range,
it trained at all (not loss and grad norm 0 on every step, as when TRL's importance-sampling correction masks every
sequence), and its per-step KL stays within `kl_tol + kl_rtol * |KL_ref|` of the reference's. Different backends draw
different random samples, so only these coarse, sampling-tolerant properties are compared, never exact values.
"""

from __future__ import annotations

import gc
import json
import math
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

# row key -> key in TRL's log dict
LOGGED = {
    "loss": "loss",
    "reward": "reward",
    "reward_std": "reward_std",
    "kl": "kl",
    "grad_norm": "grad_norm",
    "entropy": "entropy",
    "completion_len": "completions/mean_length",
    "clipped_ratio": "completions/clipped_ratio",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "logp_gap_mean": "sampling/sampling_logp_difference/mean",
    "logp_gap_max": "sampling/sampling_logp_difference/max",
    "logp_gap_p95": "sampling/sampling_logp_difference/p95",           # cb_sync's trainer only
    "ratio_outside": "sampling/ratio_outside_0.9_1.1",                   # cb_sync's trainer only
    "is_ratio_min": "sampling/importance_sampling_ratio/min",
    "is_ratio_mean": "sampling/importance_sampling_ratio/mean",
    "is_ratio_max": "sampling/importance_sampling_ratio/max",
}


class GRPOStats(TrainerCallback):
    """Collects one dict per optimizer step in `self.rows`; `write()` dumps them (and `extra`) as JSON to `path`,
    also after every logged step when `path` is given."""

    def __init__(self, backend: str, path: Path | None = None, verbose: bool = True, deadline: float | None = None,
                 min_steps: int = 2, cuda: bool | None = None):
        self.backend = backend
        self.cuda = torch.cuda.is_available() if cuda is None else cuda   # synchronise and track GPU memory
        self.path = path
        self.verbose = verbose
        self.deadline = deadline
        self.min_steps = min_steps
        self.stopped_early = False
        self.extra: dict = {}
        self.rows: list[dict] = []
        self.init_fingerprint: dict | None = None
        self._t0 = 0.0
        self._gen_s = 0.0
        self._card = None
        self._lens: list[int] | None = None
        self._cpu = 0.0
        self._compiled = 0
        _watch_triton_compiles()

    # -- timing of the rollout inside a step -------------------------------------------------------------------

    def timed(self, fn):
        """Wrap a callable (the trainer's `_generate`) so that its wall time adds to the current step's gen_s."""

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
        """Wrap the trainer's `_generate` (which returns completion ids second) so that the current step's row gets
        `completion_lens`, the length of each completion its rollouts made."""

        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            self._lens = (self._lens or []) + [len(ids) for ids in out[1]]
            return out

        return wrapper

    def sampled(self, fn):
        """Wrap a callable (vLLM's generate, say) so that the card's memory in use is sampled when it returns."""

        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            finally:
                self.sample_card()

        return wrapper

    def sample_card(self) -> float | None:
        """The card's memory in use now (GiB, every process on the device); the step's maximum keeps it."""
        if not self.cuda:
            return None
        free, total = torch.cuda.mem_get_info()
        used = (total - free) / 2**30
        self._card = used if self._card is None else max(self._card, used)
        return used

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    # -- callback events ---------------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            self.init_fingerprint = fingerprint(model)

    def on_step_begin(self, args, state, control, **kwargs):
        self._sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self._gen_s = 0.0
        self._card = None
        self._lens = None
        self._compiled = len(TRITON_COMPILES)
        self._allocator = _allocator_counts() if self.cuda else {}
        self._gc = GC_SECONDS[0]
        self._cpu = time.thread_time()
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        step_s = time.perf_counter() - self._t0
        peak = torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None
        end = self.sample_card()
        self.rows.append({"step": state.global_step, "step_s": step_s, "gen_s": self._gen_s, "peak_gib": peak,
                          "card_gib": self._card, "card_end_gib": end,
                          "main_cpu_s": round(time.thread_time() - self._cpu, 3),
                          "gc_s": round(GC_SECONDS[0] - self._gc, 4),
                          "triton_compiles": TRITON_COMPILES[self._compiled:],
                          **{key: value - self._allocator[key] for key, value in
                             (_allocator_counts() if self.cuda else {}).items()}})
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
        for key, name in LOGGED.items():
            if logs.get(name) is not None:
                row[key] = float(logs[name])
        if fresh:
            if self.verbose:
                print(f"[{self.backend}] " + format_row(row), flush=True)
            if self.path is not None:
                self.write()

    # -- output ------------------------------------------------------------------------------------------------

    def write(self, path: Path | None = None) -> None:
        """{"backend", **extra, "steps": rows} as JSON to path (default: the path given at construction)."""
        path = path or self.path
        Path(path).write_text(json.dumps({"backend": self.backend, **self.extra, "steps": self.rows}, indent=1))


TRITON_COMPILES: list[str] = []     # every kernel Triton's JIT compiled (or loaded from its disk cache), in order


def _allocator_counts() -> dict:
    """torch's caching-allocator events so far: retries after a failed allocation (each frees cached blocks and
    synchronises), and cudaMalloc / cudaFree calls."""
    stats = torch.cuda.memory_stats()
    return {"alloc_retries": stats.get("num_alloc_retries", 0), "device_allocs": stats.get("num_device_alloc", 0),
            "device_frees": stats.get("num_device_free", 0)}


GC_SECONDS = [0.0]     # the garbage collector's pauses so far (all generations)


def _gc_timer():
    started = [0.0]

    def callback(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            GC_SECONDS[0] += time.perf_counter() - started[0]
    return callback


gc.callbacks.append(_gc_timer())


def _watch_triton_compiles() -> None:
    """Record in TRITON_COMPILES each kernel specialisation Triton's JIT builds from now on (installed once): a step
    that meets a new one pays its compile on the host."""
    try:
        from triton import knobs
    except ImportError:
        return
    if not hasattr(knobs.runtime, "jit_cache_hook"):
        return
    previous = knobs.runtime.jit_cache_hook
    if getattr(previous, "records_compiles", False):
        return

    def hook(*args, **kwargs):
        TRITON_COMPILES.append(str(getattr(kwargs.get("fn"), "name", "?")))
        return previous(*args, **kwargs) if previous is not None else None
    hook.records_compiles = True
    knobs.runtime.jit_cache_hook = hook


def fingerprint(model) -> dict:
    """Count, sum and abs-sum (float64) of the trainable parameters: equal across runs that start from equal weights."""
    params = [p.detach() for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        total = sum(float(p.sum(dtype=torch.float64)) for p in params)
        absolute = sum(float(p.abs().sum(dtype=torch.float64)) for p in params)
    return {"trainable_numel": sum(p.numel() for p in params), "sum": total, "abs_sum": absolute}


def format_row(row: dict) -> str:
    parts = [f"step {row['step']}", f"{row['step_s']:.2f}s", f"gen {row['gen_s']:.2f}s"]
    if row.get("peak_gib") is not None:
        parts.append(f"peak {row['peak_gib']:.1f}GiB")
    if row.get("card_gib") is not None:
        parts.append(f"card {row['card_gib']:.1f}GiB")
    for key in ("loss", "reward", "kl", "grad_norm", "completion_len", "logp_gap_mean", "is_ratio_mean"):
        if row.get(key) is not None:
            parts.append(f"{key} {row[key]:.4g}")
    for key, least in (("gc_s", 0.01), ("alloc_retries", 1), ("device_allocs", 1), ("device_frees", 1)):
        if (row.get(key) or 0) >= least:                                        # what may stall a step
            parts.append(f"{key} {row[key]:.3g}")
    return " ".join(parts)


def trained_check(rows: list[dict]) -> dict:
    """The gate's "trained" check: fails when every step logged loss 0 and grad_norm 0."""
    idle = [r for r in rows if r.get("loss") == 0 and r.get("grad_norm") == 0]
    is_max = [r.get("is_ratio_max") for r in idle]
    masked = bool(idle) and all(x is not None and x == 0 for x in is_max)
    return {"pass": bool(rows) and len(idle) < len(rows), "idle_steps": len(idle), "steps": len(rows),
            "masked_by_is": masked, "is_ratio_max": [r.get("is_ratio_max") for r in rows]}


def _finite(x) -> bool:
    return x is not None and math.isfinite(x)


def compare(reference_rows: list[dict], other_rows: list[dict], kl_tol: float, *,
            reward_range: tuple[float, float] | None = None, kl_rtol: float = 0.0,
            logp_gap_tol: float | None = None, expected_steps: int | None = None) -> dict:
    """The equivalence gate of `other_rows` against `reference_rows` (per-step dicts from GRPOStats).

    Checks (each {"pass": bool | None, ...numbers}; None = could not be checked, not counted as a failure):
      steps:         `other_rows` has expected_steps steps (default: as many as `reference_rows`).
      losses_finite: every step of `other_rows` has a finite loss (and grad_norm when logged).
      rewards_in_range: every step's mean reward lies in reward_range = (sum of the reward functions' minima,
                     sum of their maxima).
      signal:        some step has reward_std > 0 and grad_norm > 0 (else the advantages were all zero, nothing was
                     learnt, and the KL comparison below is vacuous).
      trained:       not every step has loss 0 and grad_norm 0 (a run that trained nothing: with TRL + vLLM, the
                     importance-sampling correction masking every sequence, which `masked_by_is` names when the
                     IS ratios are logged and their max is 0 on those steps).
      kl_close:      for every step both logged, |KL_other - KL_ref| <= kl_tol + kl_rtol * |KL_ref|.
      logp_gap:      (when `other_rows` carry cb_sync's logprob gap) the largest per-step max gap between generator
                     and trainer logprobs; gated against logp_gap_tol when given, else reported only.
    "pass" overall is True when no check failed.
    """
    checks: dict[str, dict] = {}
    expected = len(reference_rows) if expected_steps is None else expected_steps
    checks["steps"] = {"pass": len(other_rows) == expected and len(other_rows) > 0, "expected": expected,
                       "reference": len(reference_rows), "other": len(other_rows)}

    losses = [r.get("loss") for r in other_rows]
    grads = [r.get("grad_norm") for r in other_rows if "grad_norm" in r]
    checks["losses_finite"] = {"pass": bool(losses) and all(_finite(x) for x in losses)
                               and all(_finite(g) for g in grads), "losses": losses}

    learning = [r for r in other_rows if (r.get("reward_std") or 0) > 0 and (r.get("grad_norm") or 0) > 0]
    checks["signal"] = {"pass": bool(learning), "steps_with_signal": len(learning)}
    checks["trained"] = trained_check(other_rows)

    rewards = [r.get("reward") for r in other_rows]
    if reward_range is None:
        checks["rewards_in_range"] = {"pass": None, "reason": "no reward range given", "rewards": rewards}
    else:
        lo, hi = reward_range
        checks["rewards_in_range"] = {"pass": bool(rewards) and all(_finite(x) and lo <= x <= hi for x in rewards),
                                      "range": [lo, hi], "rewards": rewards}

    ref_kl = {r["step"]: r.get("kl") for r in reference_rows}
    pairs = [(r["step"], ref_kl.get(r["step"]), r.get("kl")) for r in other_rows]
    pairs = [(s, a, b) for s, a, b in pairs if a is not None and b is not None]
    if not pairs:
        checks["kl_close"] = {"pass": None, "reason": "KL not logged by both runs (beta = 0?)"}
    else:
        diffs = [abs(b - a) for _, a, b in pairs]
        allowed = [kl_tol + kl_rtol * abs(a) for _, a, _ in pairs]
        checks["kl_close"] = {
            "pass": all(_finite(d) and d <= t for d, t in zip(diffs, allowed)),
            "kl_tol": kl_tol, "kl_rtol": kl_rtol,
            "reference": [a for _, a, _ in pairs], "other": [b for _, _, b in pairs],
            "max_abs_diff": max(diffs),
            "mean_reference": sum(a for _, a, _ in pairs) / len(pairs),
            "mean_other": sum(b for _, _, b in pairs) / len(pairs),
        }
    gaps = [r["logp_gap_max"] for r in other_rows if r.get("logp_gap_max") is not None]
    if gaps:
        worst = max(gaps)
        checks["logp_gap"] = {"pass": None if logp_gap_tol is None else _finite(worst) and worst <= logp_gap_tol,
                              "tol": logp_gap_tol, "max": worst,
                              "mean": [r.get("logp_gap_mean") for r in other_rows]}
    verdicts = [c["pass"] for c in checks.values() if c["pass"] is not None]
    return {"pass": all(verdicts), "checks": checks}
