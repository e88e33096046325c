"""Workload G: GRPO steps on the Qwen3-4B shape + LoRA r32, cb_sync against TRL's own generation paths.

Each backend trains a freshly built copy of the same model (same seed; the trainer adds LoRA r32 through
`peft_config`, lora_B = 0 as in the reference notebook, so the KL reference is the base model and every backend
starts from identical weights; GRPOStats fingerprints the trainable weights at train begin) on the same synthetic
math prompts with the same GRPOConfig (the reference notebook's shape: 4 generations, batch 4, temperature 0.1,
top_p 0.97, min_p 0.5, top_k 5), in one process on one card, one after the other:
    cb_sync       CBSyncGRPOTrainer (rollouts from cb_sync on the trained modules)
    trl_generate  trl.GRPOTrainer, HF `generate` (the reference of the equivalence gate)
    trl_cb        trl.GRPOTrainer(use_transformers_continuous_batching=True), transformers' own CB
    vllm, unsloth rows say why they were skipped (not installed here; not driven by this script).
A backend that fails is recorded with its error; the others still run. Results are rewritten after every backend
(per-backend step files after every step); SIGINT (`timeout -s INT`) ends the run early and keeps what was measured.

    python -m benchmarks.grpo [--tiny] [--backends cb_sync trl_generate trl_cb] [--steps 10] [--warmup 3]
                              [--max-completion 512] [--time-limit SECONDS] [--name grpo] [--out DIR]

beta defaults to 0.04 (TRL's default 0 computes and logs no KL; the gate compares KL trajectories).

The model has random weights, so EOS is silenced: the tokenizer's EOS row of the (tied) output embedding is
zeroed, its logit is exactly 0 and never among the top 5 of 151,936 random logits, so completions run to
max_completion_length (the per-step completion length is logged to show it). Random weights also make the
format/answer rewards almost always constant; a token-parity reward gives every group some variance, so the
advantages, the loss and the gradients are not zero.

Writes <out>/<name>.json (one summary row per backend, per-step rows inside), <name>.md, <name>_<backend>.json
(per-step stats) and <name>.png (if matplotlib imports). --tiny: CPU, fp32, a 2-layer Qwen3 with a 512-token
vocabulary, 3 steps of 8 tokens (the test suite's smoke run).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import random
import re
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks.common import RESULTS, build_model, environment, markdown_table, write_results
from benchmarks.grpo_stats import GRPOStats, compare

BACKENDS = ("cb_sync", "trl_generate", "trl_cb", "vllm", "unsloth")
REFERENCE = "trl_generate"
GEN_BATCH = 4          # completions per step: num_generations=4 x 1 prompt (per_device_train_batch_size=4)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# -- tokenizer: a word-level vocabulary covering every id of the model ------------------------------------------

SPECIALS = ["<pad>", "<eos>", "<bos>"]
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
WORDS = ["Solve", "the", "sum", ".", ",", "Think", "between", "and", "then", "answer", "Q", "A", ":", "What", "is",
         "+", "?"] + [str(d) for d in range(10)]


def make_tokenizer(vocab_size: int):
    """PreTrainedTokenizerFast over ids 0..vocab_size-1: special tokens and the prompt words first, then t<id>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = SPECIALS + TAGS + WORDS
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"t{i}": i for i in range(len(words), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # the tags stay ordinary tokens: TRL decodes completions with skip_special_tokens=True
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    assert len(tokenizer) == vocab_size
    return tokenizer


# -- data: few-shot two-digit additions, 130 prompt tokens at 6 shots -----------------------------------------------

def _digits(n: int) -> str:
    return " ".join(str(n))


def make_dataset(n: int = 64, shots: int = 6, seed: int = 0):
    from datasets import Dataset
    rng = random.Random(seed)
    head = "Solve the sum . Think between <think> and </think> , then answer between <answer> and </answer> ."
    prompts, answers = [], []
    for _ in range(n):
        parts = [head]
        for _ in range(shots):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            parts.append(f"Q : What is {_digits(a)} + {_digits(b)} ? A : <answer> {_digits(a + b)} </answer>")
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        parts.append(f"Q : What is {_digits(a)} + {_digits(b)} ? A :")
        prompts.append(" ".join(parts))
        answers.append(_digits(a + b))
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


# -- rewards, in the style of the reference notebook (each carries its range for the gate) ------------------------

MATCH_FORMAT = re.compile(r"</think>.*?<answer>\s*(.+?)\s*</answer>", re.DOTALL)
ANSWER = re.compile(r"<answer>\s*(.+?)\s*</answer>", re.DOTALL)


def _ranged(lo: float, hi: float):
    def mark(fn):
        fn.reward_range = (lo, hi)
        return fn
    return mark


@_ranged(0.0, 3.0)
def match_format_exactly(completions, **kwargs) -> list[float]:
    """3 when the completion closes its reasoning and gives an answer between the tags."""
    return [3.0 if MATCH_FORMAT.search(c) else 0.0 for c in completions]


@_ranged(-2.0, 2.0)
def match_format_approximately(completions, **kwargs) -> list[float]:
    """+0.5 for each of the four tags that appears exactly once, -0.5 otherwise."""
    return [sum(0.5 if c.count(tag) == 1 else -0.5 for tag in TAGS) for c in completions]


@_ranged(-1.0, 5.0)
def check_answer(completions, answer, **kwargs) -> list[float]:
    """5 for the right sum between the answer tags, -1 for a wrong one, 0 when there is none."""
    out = []
    for c, truth in zip(completions, answer):
        found = ANSWER.search(c)
        out.append(0.0 if found is None else 5.0 if found.group(1).split() == truth.split() else -1.0)
    return out


@_ranged(0.0, 1.0)
def even_token_fraction(completion_ids, **kwargs) -> list[float]:
    """The fraction of even token ids: cheap, and it varies between the samples of a group under random weights."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


REWARDS = [match_format_exactly, match_format_approximately, check_answer, even_token_fraction]
REWARD_RANGE = (sum(f.reward_range[0] for f in REWARDS), sum(f.reward_range[1] for f in REWARDS))


# -- one backend ------------------------------------------------------------------------------------------------

def build(args, tokenizer):
    """The benchmark model (random weights, seed 0) with EOS silenced; the trainer adds LoRA r32 (lora_config())."""
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    model = build_model(lora=False, tiny=args.tiny, device=device, dtype=dtype)
    with torch.no_grad():   # logit of EOS == 0: never among the top 5 of the random logits
        model.get_output_embeddings().weight[tokenizer.eos_token_id].zero_()
    for config in (model.config, model.generation_config):   # agree with the tokenizer (else transformers warns)
        config.eos_token_id, config.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        config.pad_token_id = tokenizer.pad_token_id
    return model


def lora_config():
    from peft import LoraConfig
    return LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")


def grpo_config(args, output_dir: str, **extra):
    from trl import GRPOConfig
    return GRPOConfig(
        output_dir=output_dir, num_generations=4, per_device_train_batch_size=GEN_BATCH, gradient_accumulation_steps=1,
        temperature=0.1, top_p=0.97, min_p=0.5, top_k=5, max_completion_length=args.max_completion,
        beta=args.beta, learning_rate=5e-6, logging_steps=1, report_to=[], max_steps=args.steps, seed=args.seed,
        data_seed=args.seed, save_strategy="no", bf16=not args.tiny, use_cpu=args.tiny, disable_tqdm=True,
        dataloader_num_workers=0, **extra)


def skip_reason(backend: str) -> str | None:
    """Why a peer row is skipped (vllm, unsloth), or None. Checked without importing: unsloth patches on import."""
    if backend not in ("vllm", "unsloth"):
        return None
    if importlib.util.find_spec(backend) is None:
        return f"{backend} is not installed"
    return f"{backend} is installed, but this script does not drive it yet (it needs a checkpoint on disk)"


def run_backend(backend: str, args, tokenizer, dataset, row: dict, deadline: float | None = None) -> None:
    """Train `backend` for args.steps steps (fewer if the deadline comes first); fills row as steps finish, so a
    failure keeps what was measured."""
    from transformers import PrinterCallback
    from trl import GRPOTrainer
    stats = GRPOStats(backend, path=args.out / f"{args.name}_{backend}.json", deadline=deadline, cuda=not args.tiny)
    row["per_step"] = stats.rows
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    model = build(args, tokenizer)
    common = dict(model=model, reward_funcs=REWARDS, train_dataset=dataset, processing_class=tokenizer,
                  callbacks=[stats], peft_config=lora_config())
    trainer = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if backend == "cb_sync":
                from cb_sync import CBConfig
                from cb_sync.integrations.trl import CBSyncGRPOTrainer
                # one rollout = GEN_BATCH requests: decode graphs are captured for buckets 1, 2, 4 only
                cb_config = CBConfig(max_batch_size=GEN_BATCH, max_batch_tokens=args.cb_max_batch_tokens,
                                     compile=args.cb_compile, progress_bar=False)
                trainer = CBSyncGRPOTrainer(args=grpo_config(args, tmp), cb_config=cb_config,
                                            release_after_rollout=not args.cb_keep_cache, **common)
            elif backend == "trl_generate":
                trainer = GRPOTrainer(args=grpo_config(args, tmp), **common)
            elif backend == "trl_cb":
                # TRL's default sizes transformers' KV cache to 50% of free device memory (of RAM on the CPU: slow)
                cb = {"num_blocks": 16, "max_batch_tokens": 512} if args.tiny else None
                trainer = GRPOTrainer(args=grpo_config(args, tmp, use_transformers_continuous_batching=True,
                                                       transformers_continuous_batching_config=cb), **common)
            else:
                raise ValueError(f"unknown backend {backend!r}")
            trainer.remove_callback(PrinterCallback)
            trainer._generate = stats.timed(trainer._generate)
            row["build_s"] = stats.extra["build_s"] = round(time.perf_counter() - start, 2)
            trainer.train()
    finally:
        row["init_fingerprint"] = stats.extra["init_fingerprint"] = stats.init_fingerprint
        if stats.stopped_early:
            row["stopped_early"] = True
        graphs = getattr(getattr(trainer, "_cb_driver", None), "graphs", None)
        if graphs is not None:
            row["cb_capture_s_total"] = stats.extra["cb_capture_s_total"] = round(graphs.capture_seconds, 2)
        stats.write()
        del trainer, model


def finish(row: dict, warmup: int) -> None:
    """Add the summary of the steps that finished (none: nothing to add)."""
    if row.get("per_step"):
        row.update(summarize(row["per_step"], warmup))


def summarize(per_step: list[dict], warmup: int) -> dict:
    timed = per_step[warmup:] or per_step
    peaks = [r["peak_gib"] for r in timed if r.get("peak_gib") is not None]
    lengths = [r["completion_len"] for r in per_step if r.get("completion_len") is not None]
    gaps = [r["logp_gap_max"] for r in per_step if r.get("logp_gap_max") is not None]
    return {"step_ms": round(1000 * statistics.median(r["step_s"] for r in timed), 1),
            "gen_ms": round(1000 * statistics.median(r["gen_s"] for r in timed), 1),
            "peak_gib": round(max(peaks), 2) if peaks else None,
            "timed_steps": len(timed),
            "mean_completion_len": round(statistics.mean(lengths), 1) if lengths else None,
            "logp_gap_max": max(gaps) if gaps else None}


# -- report -----------------------------------------------------------------------------------------------------

def _fmt(x, digits=4):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if math.isfinite(x) else str(x)
    return str(x)


def _verdict(gate: dict | None) -> str:
    return "-" if gate is None else "pass" if gate["pass"] else "FAIL"


def summary_table(rows: list[dict]) -> str:
    """One line per backend; ratios are peer / cb_sync for time and cb_sync / peer for memory, this run only."""
    cb = next((r for r in rows if r["engine"] == "cb_sync" and r.get("step_ms") is not None), None)
    out = []
    for r in rows:
        note = r.get("skipped") or (f"error: {r['error'][:100]}" if r.get("error") else "")
        if r.get("step_ms") is None:
            out.append([r["engine"], "-", "-", "-", "-", "-", "-", note or "no step finished"])
            continue
        ratio = "-"
        if cb is not None and r is not cb:
            mem = f"{cb['peak_gib'] / r['peak_gib']:.2f}x" if cb.get("peak_gib") and r.get("peak_gib") else "-"
            ratio = f"{r['step_ms'] / cb['step_ms']:.2f}x / {r['gen_ms'] / cb['gen_ms']:.2f}x / {mem}"
        verdict = (f"reference ({_verdict(r.get('gate_self'))})" if r["engine"] == REFERENCE
                   else _verdict(r.get("gate") or r.get("gate_self")))
        steps = f"{len(r['per_step'])}/{r['steps']}" + (" (time limit)" if r.get("stopped_early") else "")
        out.append([r["engine"], steps, r["step_ms"], r["gen_ms"], _fmt(r["peak_gib"]), _fmt(r["mean_completion_len"]),
                    verdict, ratio + (f" ({note})" if note else "")])
    return markdown_table(["backend", "steps", "median step ms", "median rollout ms", "peak GiB", "completion len",
                           "gate", "peer/cb_sync: step time / rollout time; cb_sync/peer: peak memory"], out)


def step_table(per_step: list[dict]) -> str:
    keys = ["step", "step_s", "gen_s", "peak_gib", "loss", "reward", "reward_std", "kl", "grad_norm",
            "completion_len", "logp_gap_mean", "logp_gap_max"]
    return markdown_table(keys, [[_fmt(r.get(k)) for k in keys] for r in per_step])


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
    out = []
    if "trl_cb" in ran:
        out.append("- trl_cb: transformers' CB warns that it may not apply `min_p`; on the GPU TRL casts the whole "
                   "model, LoRA included, to bf16 before each `generate_batch` (the other backends keep LoRA in fp32). "
                   + ("Its KV cache is TRL's default, 50% of free device memory." if not args.tiny
                      else "Its KV cache is 16 blocks here (CPU)."))
    if not args.tiny:
        out.append("- Outside reference (B200, the reference notebook, not comparable as a ratio): vLLM median step "
                   "4.14 s at 158 GB peak; Unsloth HF path 23.95 s at 10.7 GB; transformers CB 36 s at 55.6 GB.")
    return ["## Notes", "", *out, ""] if out else []


def report(args, rows: list[dict], prompt_len: int) -> str:
    shape = "tiny Qwen3 (2 layers, vocab 512), fp32, CPU" if args.tiny else "Qwen3-4B shape, bf16"
    prints = {json.dumps(r["init_fingerprint"], sort_keys=True) for r in rows if r.get("init_fingerprint")}
    same = ("identical across backends" if len(prints) == 1 else "DIFFERENT across backends" if prints
            else "not recorded")
    text = [f"# Workload G (GRPO): {shape}, LoRA r32 on all 7 projections", "",
            f"{args.steps} steps ({args.warmup} warm-up, left out of the medians), {GEN_BATCH} completions per step "
            f"(1 prompt x 4 generations), prompt {prompt_len} tokens, completions to {args.max_completion} tokens "
            f"(EOS silenced), temperature 0.1, top_p 0.97, min_p 0.5, top_k 5, lr 5e-6, beta {args.beta}, "
            f"seed {args.seed}. The backends ran in one process on one device ({environment()['card']}), one after "
            f"the other, each on a freshly built copy of the same weights (initial trainable weights {same}). "
            "Step time: optimizer step begin to end (rollout, rewards, logprob passes, backward, optimizer), device "
            "synchronised; rollout time: TRL's `_generate`. Peak GiB: max over timed steps of "
            "torch.cuda.max_memory_allocated (reset at every step begin).",
            "", "## Summary", "", summary_table(rows),
            "## Equivalence gate", "",
            f"Against {REFERENCE}: every step done, finite losses and grad norms, mean reward within the reward "
            f"functions' range {list(REWARD_RANGE)}, some step with non-zero advantages (reward_std > 0 and "
            f"grad_norm > 0), per-step |KL - KL_ref| <= {args.kl_atol:g} + {args.kl_rtol:g} x |KL_ref| (backends draw "
            "different samples, so KL can agree only statistically); cb_sync's generator-vs-trainer logprob gap is "
            + (f"gated at {args.logp_gap_tol:g}." if args.logp_gap_tol is not None else "reported."), ""]
    text += gate_lines(rows) or ["- no backend finished a step"]
    text.append("")
    for r in rows:
        if r.get("per_step"):
            extra = f", decode-graph capture {r['cb_capture_s_total']} s in all" if "cb_capture_s_total" in r else ""
            text += [f"## {r['engine']} per step (model and trainer built in {r.get('build_s', '-')} s{extra})", "",
                     step_table(r["per_step"])]
    text += notes(args, rows)
    cb = next((r for r in rows if r["engine"] == "cb_sync" and r.get("per_step")), None)
    if cb is not None:
        text += ["## cb_sync: generator vs trainer logprob gap per step", "",
                 "mean / max |log p_generator - log p_trainer| over completion tokens: "
                 + ", ".join(f"step {s['step']}: {_fmt(s.get('logp_gap_mean'), 3)} / {_fmt(s.get('logp_gap_max'), 3)}"
                             for s in cb["per_step"]), ""]
    return "\n".join(text)


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


# -- main -------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny Qwen3, fp32")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (10; tiny 3)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the medians (3; tiny 1)")
    parser.add_argument("--max-completion", type=int, default=None, help="max_completion_length (512; tiny 8)")
    parser.add_argument("--shots", type=int, default=6, help="worked examples per prompt (6 -> 130 tokens)")
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient (> 0 so that KL is logged)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kl-atol", type=float, default=1e-3, help="gate: absolute per-step KL tolerance")
    parser.add_argument("--kl-rtol", type=float, default=1.0, help="gate: KL tolerance relative to the reference")
    parser.add_argument("--cb-compile", action="store_true", help="torch.compile cb_sync's decode step")
    parser.add_argument("--cb-max-batch-tokens", type=int, default=512)
    parser.add_argument("--cb-keep-cache", action="store_true",
                        help="CBSyncGRPOTrainer(release_after_rollout=False): keep KV cache and graphs across steps")
    parser.add_argument("--logp-gap-tol", type=float, default=None,
                        help="gate: max |generator - trainer| logprob for cb_sync (1e-3 with --tiny; GPU: report only)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds for all backends together: each gets an equal share of what is left and stops "
                             "early (after >= 2 steps) when its next step would overrun it")
    parser.add_argument("--name", default="grpo")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.logp_gap_tol is None and args.tiny:
        args.logp_gap_tol = 1e-3
    for key, full, tiny in (("steps", 10, 3), ("warmup", 3, 1), ("max_completion", 512, 8)):
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    return args


def evaluate_gates(args, rows: list[dict]) -> None:
    reference = next((r for r in rows if r["engine"] == REFERENCE and r.get("per_step")), None)
    kwargs = dict(reward_range=REWARD_RANGE, kl_rtol=args.kl_rtol, logp_gap_tol=args.logp_gap_tol)
    for r in rows:
        r.pop("gate", None)
        r.pop("gate_self", None)
        # a backend stopped by --time-limit is expected to have the steps it had time for
        kwargs["expected_steps"] = len(r.get("per_step") or []) if r.get("stopped_early") else args.steps
        if r.get("per_step") and reference is not None and r is not reference:
            r["gate"] = compare(reference["per_step"], r["per_step"], args.kl_atol, **kwargs)
        elif r.get("per_step"):   # the reference itself, or no reference: the checks that need none
            r["gate_self"] = compare(r["per_step"], r["per_step"], args.kl_atol, **kwargs)


def versions() -> dict:
    """Versions of the training stack next to the torch/transformers/triton ones that write_results adds."""
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for package in ("trl", "peft", "accelerate", "datasets"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = None
    return out


def save(args, rows: list[dict], prompt_len: int) -> None:
    evaluate_gates(args, rows)
    write_results(args.name, rows, report(args, rows, prompt_len), out_dir=args.out)
    plot(rows, args.out / f"{args.name}.png")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --tiny for the CPU smoke run)")
    tokenizer = make_tokenizer(512 if args.tiny else 151936)
    dataset = make_dataset(n=64, shots=args.shots, seed=args.seed)
    prompt_len = len(tokenizer(dataset[0]["prompt"], add_special_tokens=False)["input_ids"])
    base = {"model": "qwen3-tiny" if args.tiny else "qwen3-4b-shape", "lora": True, "batch": GEN_BATCH,
            "num_generations": 4, "prompt_len": prompt_len, "new_tokens": args.max_completion, "steps": args.steps,
            "warmup": args.warmup, "beta": args.beta, **versions()}
    print(f"GRPO benchmark: {base}", flush=True)

    rows: list[dict] = []
    start = time.perf_counter()
    runnable = [b for b in args.backends if skip_reason(b) is None]
    try:
        for backend in args.backends:
            row = {"engine": backend, **base}
            rows.append(row)
            reason = skip_reason(backend)
            if reason is not None:
                row["skipped"] = reason
                print(f"[{backend}] skipped: {reason}", flush=True)
                continue
            deadline = None
            if args.time_limit is not None:   # an equal share of what is left to each backend still to run
                left = len(runnable) - runnable.index(backend)
                now = time.perf_counter()
                deadline = now + (start + args.time_limit - now) / left
            try:
                run_backend(backend, args, tokenizer, dataset, row, deadline)
            except Exception as error:          # one failing backend must not stop the others
                traceback.print_exc()
                row["error"] = repr(error)[:2000]
                print(f"[{backend}] failed: {error!r}", flush=True)
            finish(row, args.warmup)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            save(args, rows, prompt_len)     # after every backend: a run cut short keeps what it measured
    except KeyboardInterrupt:                # e.g. `timeout -s INT`: keep what was measured, run nothing more
        print(f"interrupted during {rows[-1]['engine'] if rows else 'setup'}", flush=True)
        if rows and "step_ms" not in rows[-1] and "skipped" not in rows[-1]:
            rows[-1].setdefault("error", "interrupted")
            finish(rows[-1], args.warmup)
        rows += [{"engine": b, **base, "skipped": "not reached: the run was interrupted"}
                 for b in args.backends[len(rows):]]
    save(args, rows, prompt_len)
    print("\n" + summary_table(rows))
    for line in gate_lines(rows):
        print(line)
    print(f"results: {args.out / (args.name + '.md')}", flush=True)
    return rows


if __name__ == "__main__":
    main()
