"""Workloads G and G2's report: the summary, completion-length, per-step and gate tables of <name>.md and the
per-step plot <name>.png."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.common import environment, markdown_table
from benchmarks.grpo_peers import OWN_PROCESS
from benchmarks.grpo_workload import GEN_BATCH, REFERENCE, REWARD_RANGE

SHAPES = {"qwen3-tiny": "tiny Qwen3 (2 layers, vocab 512), fp32, CPU", "qwen3-4b-shape": "Qwen3-4B shape, bf16",
          "qwen3-1.7b-shape": "Qwen3-1.7B shape, bf16"}


def _fmt(x, digits=4):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if math.isfinite(x) else str(x)
    return str(x)


def _verdict(gate: dict | None) -> str:
    return "-" if gate is None else "pass" if gate["pass"] else "FAIL"


def _memory_ratio(cb: dict, r: dict) -> str:
    """cb_sync / peer of the card's memory in use where both have it, else of torch's peak."""
    for key, label in (("card_gib", "card"), ("peak_gib", "peak")):
        if cb.get(key) and r.get(key):
            return f"{cb[key] / r[key]:.2f}x {label}"
    return "-"


def _gap(r: dict) -> str:
    """Generator-vs-trainer logprob gap (mean / max; cb_sync: mean / p95 / max and the share of tokens whose ratio
    lies outside [0.9, 1.1]) and TRL's importance-sampling ratio (mean, min)."""
    parts = []
    if r.get("logp_gap_p95") is not None:
        parts.append(f"{_fmt(r['logp_gap_mean'], 3)} / {_fmt(r['logp_gap_p95'], 3)} / {_fmt(r['logp_gap_max'], 3)}, "
                     f"{100 * r['ratio_outside']:.1f}% outside [0.9, 1.1]")
    elif r.get("logp_gap_mean") is not None:
        parts.append(f"{_fmt(r['logp_gap_mean'], 3)} / {_fmt(r['logp_gap_max'], 3)}")
    if r.get("is_ratio_mean") is not None:
        parts.append(f"IS {_fmt(r['is_ratio_mean'], 3)} (min {_fmt(r['is_ratio_min'], 3)})")
    return "; ".join(parts) or "-"


def _driver(r: dict) -> str:
    """cb_sync's driver alone on the last rollout's requests (ms), and the rollout's time over it."""
    if r.get("driver_alone_s") is None:
        return "-"
    return f"{1000 * r['driver_alone_s']:.1f} ({_fmt(r.get('rollout_vs_driver'), 3)}x)"


def summary_table(rows: list[dict]) -> str:
    """One line per backend; ratios are peer / cb_sync for time and cb_sync / peer for memory, this run only."""
    cb = next((r for r in rows if r["engine"] == "cb_sync" and r.get("step_ms") is not None), None)
    out = []
    for r in rows:
        note = r.get("skipped") or (f"error: {r['error'][:300]}" if r.get("error") else "")
        if r.get("step_ms") is None:
            out.append([r["engine"], "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", note or "no step finished"])
            continue
        ratio = "-"
        if cb is not None and r is not cb:
            ratio = (f"{r['step_ms'] / cb['step_ms']:.2f}x / {r['gen_ms'] / cb['gen_ms']:.2f}x / "
                     f"{_memory_ratio(cb, r)}")
        gate = r.get("gate") or r.get("gate_self")
        verdict = f"reference ({_verdict(gate)})" if r["engine"] == REFERENCE else _verdict(gate)
        trained = (gate or {}).get("checks", {}).get("trained")
        if trained is not None and trained["pass"] is False:
            verdict += " (trained nothing" + (": IS correction masked every sequence)" if trained["masked_by_is"]
                                              else ")")
        steps = f"{len(r['per_step'])}/{r['steps']}" + (" (time limit)" if r.get("stopped_early") else "")
        if r.get("median_includes_warmup"):
            steps += ", medians over warm-up steps only"
        out.append([r["engine"], steps, r["step_ms"], r["gen_ms"], _fmt(r.get("rollout_tok_s")), _driver(r),
                    _fmt(r["peak_gib"]), _fmt(r.get("card_gib")), _fmt(r["mean_completion_len"]), _gap(r), verdict,
                    ratio + (f" ({note})" if note else "")])
    return markdown_table(["backend", "steps", "median step ms", "median rollout ms", "rollout tok/s",
                           "driver alone ms (rollout / driver)", "peak GiB (torch)", "card GiB in use (max)",
                           "completion len", "logprob gap mean / (p95 /) max; IS ratio", "gate",
                           "peer/cb_sync: step time / rollout time; cb_sync/peer: memory"], out)


def length_table(rows: list[dict]) -> str | None:
    """Completion lengths per backend over every rollout (None: no backend recorded them)."""
    ran = [r for r in rows if r.get("len_mean") is not None]
    if not ran:
        return None
    return markdown_table(["backend", "completions", "mean", "p50", "p90", "max", "clipped at max (TRL, mean)"],
                          [[r["engine"], r["len_count"], r["len_mean"], r["len_p50"], r["len_p90"], r["len_max"],
                            _fmt(r.get("clipped_share"), 3)] for r in ran])


def step_table(per_step: list[dict]) -> str:
    keys = ["step", "step_s", "gen_s", "peak_gib", "card_gib", "loss", "reward", "reward_std", "kl", "grad_norm",
            "completion_len", "logp_gap_mean", "logp_gap_p95", "logp_gap_max", "ratio_outside", "is_ratio_min",
            "is_ratio_mean", "is_ratio_max"]
    cells = [[_fmt(r.get(k)) for k in keys] for r in per_step]
    if any("completion_lens" in r for r in per_step):       # EOS live: what each rollout generated
        keys = keys + ["completion_tokens", "len_max", "clipped_ratio"]
        for row, r in zip(cells, per_step):
            lens = r.get("completion_lens") or []
            row += [sum(lens), max(lens, default="-"), _fmt(r.get("clipped_ratio"))]
    return markdown_table(keys, cells)


def _describe(name: str, check: dict) -> str:
    verdict = "n/a" if check["pass"] is None else "pass" if check["pass"] else "FAIL"
    extra = ""
    if name == "kl_close" and "max_abs_diff" in check:
        extra = (f" (max |dKL| {check['max_abs_diff']:.3g}, allowed {check['kl_tol']:g} + {check['kl_rtol']:g} x "
                 f"|KL_ref|; mean KL {check['mean_other']:.3g} vs {check['mean_reference']:.3g})")
    elif name == "rewards_in_range" and "range" in check:
        found = [x for x in check["rewards"] if x is not None]
        extra = (f" (rewards {min(found):.3g}..{max(found):.3g} in {check['range']})" if found
                 else " (no reward logged)")
    elif name == "logp_gap":
        tol = f"tol {check['tol']:g}" if check["tol"] is not None else "report only"
        extra = f" (max {check['max']:.3g}, {tol})"
    elif name == "signal":
        extra = f" ({check['steps_with_signal']} steps with reward_std > 0 and grad_norm > 0)"
    elif name == "trained":
        extra = f" (loss and grad norm 0 on {check['idle_steps']} of {check['steps']} steps"
        if check["pass"] is False:
            extra += ": trained nothing"
            if check["masked_by_is"]:
                extra += "; IS ratio max 0 on every step: the importance-sampling correction masked every sequence"
        extra += ")"
    elif name == "steps":
        extra = f" ({check['other']} of {check['expected']})"
    return f"{name} {verdict}{extra}"


def gate_lines(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        gate, against = (r["gate"], REFERENCE) if r.get("gate") else (r.get("gate_self"), "itself")
        if gate is None:
            continue
        lines.append(f"- {r['engine']} vs {against}: **{_verdict(gate)}**; "
                     + "; ".join(_describe(n, c) for n, c in gate["checks"].items()))
    return lines


def notes(args, rows: list[dict]) -> list[str]:
    ran = {r["engine"] for r in rows if r.get("per_step")}
    g = rows[0].get("workload", "G") == "G"
    out = []
    if "trl_cb" in ran:
        out.append("- trl_cb: " + ("transformers' CB warns that it may not apply `min_p`; " if g else "")
                   + "on the GPU TRL casts the whole "
                   "model, LoRA included, to bf16 before each `generate_batch` (the other backends keep LoRA in fp32). "
                   + ("Its KV cache is TRL's default, 50% of free device memory." if not args.tiny
                      else "Its KV cache is 16 blocks here (CPU)."))
    if ran & {"trl_vllm", "trl_vllm_sleep"}:
        out.append("- trl_vllm, trl_vllm_sleep: TRL's vLLM colocate path with its defaults (vLLM reserves "
                   "vllm_gpu_memory_utilization of the card; importance-sampling correction on, sequence_mask); TRL "
                   "merges the LoRA into the bf16 weights and loads them into vLLM before each rollout, so vLLM "
                   "decodes without LoRA; trl_vllm_sleep frees vLLM's weights and KV pool outside the rollout.")
    if "unsloth" in ran:
        out.append("- unsloth: Unsloth's own GRPO path (FastLanguageModel, fast_inference=False: its HF-generate "
                   "rollouts), its LoRA via get_peft_model (use_gradient_checkpointing='unsloth'), in its own "
                   "process with TRL <= 1.15.")
    if not args.tiny and g:
        out.append("- Outside reference (B200, the reference notebook, not comparable as a ratio): vLLM median step "
                   "4.14 s at 158 GB peak; Unsloth HF path 23.95 s at 10.7 GB; transformers CB 36 s at 55.6 GB.")
    return ["## Notes", "", *out, ""] if out else []


def workload_text(args, first: dict, prompt_len: int) -> tuple[str, str]:
    """The report's title and the sentences that say what a step of the run's workload does."""
    model = first.get("model") or ("qwen3-tiny" if args.tiny else "qwen3-4b-shape")
    shape = SHAPES.get(model, model)
    if first.get("workload", "G") == "G":
        return (f"# Workload G (GRPO): {shape}, LoRA r32 on all 7 projections",
                f"{args.steps} steps ({args.warmup} warm-up, left out of the medians), {GEN_BATCH} completions per "
                f"step (1 prompt x 4 generations), prompt {prompt_len} tokens, completions to {args.max_completion} "
                f"tokens (EOS silenced), temperature 0.1, top_p 0.97, min_p 0.5, top_k 5, lr 5e-6, beta {args.beta}, "
                f"seed {args.seed}.")
    batch, micro, stops = first["batch"], first["micro_batch"], first["stop_tokens"]
    shots = first["shots"] if isinstance(first["shots"], int) else "..".join(map(str, first["shots"]))
    sampling = ", ".join(f"{k} {v}" for k, v in first["sampling"].items())
    return (f"# Workload G2 (GRPO as users run it): {shape}, LoRA r32 on all 7 projections",
            f"{args.steps} steps ({args.warmup} warm-up, left out of the medians). A step is one optimizer step on "
            f"one rollout of {batch} completions ({first['prompts']} prompts x {first['num_generations']} "
            f"generations: TRL's generation batch), trained in {batch // micro} micro-batches of {micro} "
            f"(per_device_train_batch_size {micro}, gradient_accumulation_steps = steps_per_generation = "
            f"{batch // micro}). Prompts of {first['prompt_len_min']}..{first['prompt_len_max']} tokens (mean "
            f"{first['prompt_len_mean']}; {shots} worked examples, the count drawn per prompt). Completions to "
            f"{args.max_completion} tokens with EOS live: {stops} stop tokens (the tokenizer's EOS and the top "
            f"{stops - 1} ids of the {first['vocab']}-id vocabulary, ordinary random rows of the output embedding: "
            f"under random weights at temperature 1 a token stops with probability ~{stops}/{first['vocab']}, a "
            f"geometric length law capped at {args.max_completion} with mean {first['target_mean_len']}). Sampling: "
            f"GRPOConfig's defaults, left unset ({sampling}). lr 5e-6, beta {args.beta}, seed {args.seed}.")


def report(args, rows: list[dict], prompt_len: int, sources: list[str] = (), differ: list[str] = ()) -> str:
    """<name>.md; `sources`: the runs a merged report was made from, `differ`: settings that differ between them."""
    title, shape_text = workload_text(args, rows[0], prompt_len)
    card = next((r["card"] for r in rows if r.get("card")), None) or environment()["card"]
    prints = {json.dumps(r["init_fingerprint"], sort_keys=True) for r in rows if r.get("init_fingerprint")}
    same = ("identical across backends" if len(prints) == 1 else "DIFFERENT across backends" if prints
            else "not recorded")
    text = [title, "",
            f"{shape_text} The backends ran on one device ({card}), one after the other "
            f"({', '.join(OWN_PROCESS)} each in a process of its own, the others in the run's process), each on a "
            f"freshly built copy of the same weights (initial trainable weights {same}). "
            "Step time: optimizer step begin to end (rollout, rewards, logprob passes, backward, optimizer), device "
            "synchronised; rollout time: TRL's `_generate`. Rollout tok/s: the rollout's completion tokens (the "
            "recorded lengths' sum, else TRL's mean length x completions) over its time, median over timed steps. "
            "Driver alone (cb_sync): after training, the trainer's driver called alone to repeat the last rollout "
            "(its requests and sampling parameters, the trainable weights it decoded with and its seeds; whether "
            "the tokens came back the same is in the json, `driver_alone_same_tokens`), the KV cache released "
            "before each call where the trainer releases it after a rollout, median of 2 calls; rollout / driver: "
            "the last rollout's time over it. Peak GiB: max over timed steps of "
            "torch.cuda.max_memory_allocated (reset at every step begin). Card GiB: the device's memory in use "
            "(torch.cuda.mem_get_info: every process and pool, vLLM's included), the max over a step's samples "
            "(after the rollout, after vLLM's generate, at the step's end), max over timed steps."
            + (" The trainers' SDPA ran without cuDNN attention (`--sdpa-cudnn off`)."
               if rows[0].get("sdpa_cudnn") == "off" else "")
            + (f" Merged from the runs {', '.join(sources)} (one machine, one lease)." if sources else "")
            + (f" These settings DIFFER between them: {', '.join(differ)}." if differ else ""),
            "", "## Summary", "", summary_table(rows)]
    lengths = length_table(rows)
    if lengths is not None:
        text += ["## Completion lengths", "", "Every completion of every rollout (warm-up steps included); clipped: "
                 "TRL's `completions/clipped_ratio` (no stop token at the end), mean over steps.", "", lengths]
    text += ["## Equivalence gate", "",
             f"Against {REFERENCE}: every step done, finite losses and grad norms, mean reward within the reward "
             f"functions' range {list(REWARD_RANGE)}, some step with non-zero advantages (reward_std > 0 and "
             "grad_norm > 0), not loss and grad norm 0 on every step (trained nothing), "
             f"per-step |KL - KL_ref| <= {args.kl_atol:g} + {args.kl_rtol:g} x |KL_ref| (backends draw "
             "different samples, so KL can agree only statistically); the generator-vs-trainer logprob gap is "
             + (f"gated at {args.logp_gap_tol:g}." if args.logp_gap_tol is not None else "reported."), ""]
    text += gate_lines(rows) or ["- no backend finished a step"]
    text.append("")
    for r in rows:
        if r.get("per_step"):
            extra = f", decode-graph capture {r['cb_capture_s_total']} s in all" if "cb_capture_s_total" in r else ""
            if r.get("cb_compiled") is False and args.cb_compile:
                extra += "; the decode step's compile failed and it ran uncompiled"
            text += [f"## {r['engine']} per step (model and trainer built in {r.get('build_s', '-')} s{extra})", "",
                     step_table(r["per_step"])]
    text += notes(args, rows)
    for r in rows:
        if any(s.get("logp_gap_mean") is not None for s in r.get("per_step") or []):
            text += [f"## {r['engine']}: generator vs trainer logprob gap per step", "",
                     "mean / max |log p_generator - log p_trainer| over completion tokens: "
                     + ", ".join(f"step {s['step']}: {_fmt(s.get('logp_gap_mean'), 3)} / "
                                 f"{_fmt(s.get('logp_gap_max'), 3)}" for s in r["per_step"]), ""]
        if r.get("weight_sync"):
            text += [f"## {r['engine']}: does TRL's weight sync reach vLLM?", "", weight_sync_line(r["weight_sync"]),
                     ""]
    return "\n".join(text)


def weight_sync_line(check: dict) -> str:
    """One sentence from grpo_peers.weight_sync_check's result."""
    if "error" in check:
        return f"Not checked: {check['error']}"
    return (f"After the last optimizer step, TRL's sync pushed the trainer's weights into vLLM once more; "
            f"`{check['name']}` in vLLM then differed from the trainer's merged weight (W + B A s as PEFT merges it, "
            f"computed here) in {check['mismatch_vs_trainer']} of {check['numel']} elements (max |diff| "
            f"{_fmt(check['max_abs_vs_trainer'], 3)}); it differed from the checkpoint vLLM started from in "
            f"{check['changed_vs_start']} elements (the LoRA update's max |B A s| {_fmt(check['lora_delta_max'], 3)}, "
            f"so {check['expected_changed']} elements had to change); the sync changed "
            f"{_fmt(check.get('changed_by_last_sync'))} elements of vLLM's copy. The trainer's frozen base weight "
            f"differs from the checkpoint in {check['base_drift']} elements (TRL merges and unmerges the adapter in "
            f"the weights' dtype at every sync). Verdict: {SYNC_VERDICTS[check['reaches']]}.")


SYNC_VERDICTS = {True: "the sync reaches vLLM", False: "the sync does NOT reach vLLM",
                 None: "cannot tell (the LoRA update is below the weights' resolution everywhere)"}


def plot(rows: list[dict], path: Path) -> bool:
    """Step time, peak memory and KL per step, one line per backend; skipped (False) without matplotlib."""
    ran = [r for r in rows if r.get("per_step")]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except Exception:
        return False
    if not ran:
        return False
    try:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        series = [("step_s", "step time (s)"), ("peak_gib", "peak GPU memory (GiB)"),
                  ("kl", "KL to the reference (base) model")]
        for ax, (key, title) in zip(axes, series):
            for r in ran:
                points = [(s["step"], s[key]) for s in r["per_step"] if s.get(key) is not None]
                if points:
                    ax.plot(*zip(*points), marker="o", label=r["engine"])
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
            else:
                ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return True
    except Exception as error:        # a plot must never cost the measured results
        print(f"plot skipped: {error!r}", flush=True)
        return False
