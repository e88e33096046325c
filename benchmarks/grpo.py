"""Workloads G and G2: GRPO steps on the Qwen3-4B shape (--model qwen3-1.7b: the 1.7B one) + LoRA r32, cb_sync
against TRL's own generation paths.

Each backend trains a freshly built copy of the same model (same seed; the trainer adds LoRA r32 through
`peft_config`, lora_B = 0 as in the reference notebook, so the KL reference is the base model and every backend
starts from identical weights; GRPOStats fingerprints the trainable weights at train begin) on the same synthetic
math prompts with the same GRPOConfig, on one card, one after the other:
    cb_sync         CBSyncGRPOTrainer (rollouts from cb_sync on the trained modules)
    trl_generate    trl.GRPOTrainer, HF `generate` (the reference of the equivalence gate)
    trl_cb          trl.GRPOTrainer(use_transformers_continuous_batching=True), transformers' own CB
    trl_vllm        trl.GRPOTrainer(use_vllm=True, vllm_mode="colocate"), TRL's defaults otherwise
    trl_vllm_sleep  the same with vllm_enable_sleep_mode=True
    unsloth         Unsloth's own GRPO path (fast_inference=False), TRL <= 1.15 from --unsloth-site
The first three run in this process; the others each in a process of its own (benchmarks/grpo_peers.py), from the
model saved to a directory. A backend that cannot run here has a row that says why; one that fails is recorded
with its error; the others still run. Results are rewritten after every backend (per-backend step files after
every step); SIGINT (`timeout -s INT`) ends the run early and keeps what was measured.

    python -m benchmarks.grpo [--tiny] [--workload G|G2] [--model qwen3-4b|qwen3-1.7b]
                              [--backends cb_sync trl_generate trl_cb trl_vllm ...] [--steps 10] [--warmup 3]
                              [--max-completion N] [--time-limit SECONDS] [--name grpo] [--out DIR]
                              [--cb-compile] [--cb-compile-layers] [--cb-group-by-length auto|on|off]
                              [--cb-release-cache auto|on|off] ...

--workload G (the default), the reference notebook's shape: a step is one optimizer step on one rollout of 4
completions (1 prompt x 4 generations, per_device_train_batch_size 4), temperature 0.1, top_p 0.97, min_p 0.5,
top_k 5, prompts of 130 tokens (6 worked examples), completions to 512 tokens. The model has random weights, so EOS
is silenced: the tokenizer's EOS row of the (tied) output embedding is zeroed, its logit is exactly 0 and never
among the top 5 of 151,936 random logits, so completions run to max_completion_length (the per-step completion
length is logged to show it).

--workload G2, GRPO as users run it: a step is one optimizer step on one rollout of 64 completions (8 prompts x
num_generations 8: TRL's generation batch), trained in 4 micro-batches of 16 (per_device_train_batch_size 16,
gradient_accumulation_steps = steps_per_generation = 4: TRL generates once per optimizer step; the logits of 64
sequences of up to ~1500 tokens over 151,936 ids would not fit one backward of the 4B model). Sampling is TRL's
default (temperature 1.0, top_p 1.0, top_k 0, min_p None: GRPOConfig's fields left unset). Prompts have 77..505
tokens (3..28 worked examples, the count drawn per prompt from --seed). Completions go to 1024 tokens with EOS live:
the stop tokens are the tokenizer's EOS and the top ids of the vocabulary, whose output rows are ordinary random
rows, so that random logits at temperature 1 stop a completion with probability p = count / vocab per token; the
count makes the capped geometric length's mean (1 - (1 - p)^1024) / p equal 400: 342 of 151,936 (median ~308,
~10% clipped at 1024). They are the model's generation_config.eos_token_id, which TRL reads into its eos_token_ids
(the stop list of HF generate, transformers' CB and cb_sync, and of TRL's completion masks) and vLLM from the saved
generation_config.json (TRL + vLLM also get them as stop_token_ids). Each rollout's completion lengths are recorded
and summarised (mean, p50, p90, max; TRL's clipped ratio). cb_sync's CBConfig: max_batch_size 64 (one rollout),
max_batch_tokens 2048 (--cb-max-batch-tokens).

Both: beta defaults to 0.04 (TRL's default 0 computes and logs no KL; the gate compares KL trajectories). Random
weights make the format/answer rewards almost always constant; a token-parity reward gives every group some
variance, so the advantages, the loss and the gradients are not zero. cb_sync, after training: the driver alone
repeats the last rollout exactly (its prompt ids, the trainer's sampling parameters, the trainable weights it decoded
with, copied to the host between steps, and the RNG state its seeds were drawn from), the KV cache released before
each of 2 timed calls where the trainer releases it after a rollout: `driver_alone_s` (median), whether both calls
returned the rollout's tokens (`driver_alone_same_tokens`), and `rollout_vs_driver` (the last rollout's time over it).

Writes <out>/<name>.json (one summary row per backend, per-step rows inside), <name>.md, <name>_<backend>.json
(per-step stats) and <name>.png (if matplotlib imports). --tiny: CPU, fp32, a 2-layer Qwen3 with a 512-token
vocabulary; G: 3 steps of 8 tokens (the test suite's smoke run); G2: 2 steps of 2 prompts x 4 generations in
micro-batches of 4, completions to 16 tokens, 53 stop tokens of 512 (mean 8).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch
from transformers import TrainerCallback

from benchmarks import grpo_peers
from benchmarks.common import MODEL_CONFIGS, RESULTS, build_model, write_results
from benchmarks.grpo_report import gate_lines, plot, report, summary_table
from benchmarks.grpo_stats import GRPOStats, compare
from benchmarks.grpo_workload import (AUTO_ON_OFF, G, REFERENCE, REWARD_RANGE, REWARDS, WORKLOADS, Workload,
                                      lora_config, make_dataset, make_tokenizer, stop_token_ids, workload)

BACKENDS = ("cb_sync", "trl_generate", "trl_cb", "trl_vllm", "trl_vllm_sleep", "unsloth")

# -- one backend ------------------------------------------------------------------------------------------------

def build(args, tokenizer, stops: list[int] | None = None, shape: str = "qwen3-4b"):
    """The benchmark model (random weights, seed 0; `shape`: a key of MODEL_CONFIGS) with EOS silenced, or, given
    `stops`, with these stop tokens as its EOS ids; the trainer adds LoRA r32 (lora_config())."""
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    model = build_model(lora=False, tiny=args.tiny, device=device, dtype=dtype, shape=shape)
    if stops is None:
        with torch.no_grad():   # logit of EOS == 0: never among the top 5 of the random logits
            model.get_output_embeddings().weight[tokenizer.eos_token_id].zero_()
    for config in (model.config, model.generation_config):   # agree with the tokenizer (else transformers warns)
        config.eos_token_id, config.bos_token_id = stops or tokenizer.eos_token_id, tokenizer.bos_token_id
        config.pad_token_id = tokenizer.pad_token_id
    return model


def grpo_config(args, output_dir: str, work: Workload = G, **extra):
    from trl import GRPOConfig
    return GRPOConfig(
        output_dir=output_dir, num_generations=work.num_generations, per_device_train_batch_size=work.micro_batch,
        gradient_accumulation_steps=work.accumulation, **work.sampling, max_completion_length=args.max_completion,
        beta=args.beta, learning_rate=5e-6, logging_steps=1, report_to=[], max_steps=args.steps, seed=args.seed,
        data_seed=args.seed, save_strategy="no", bf16=not args.tiny, use_cpu=args.tiny, disable_tqdm=True,
        dataloader_num_workers=0, **extra)


def stop_ids(args, tokenizer) -> list[int] | None:
    """The workload's stop tokens, EOS first (stop_token_ids); None where EOS is silenced."""
    if args.work.mean_completion is None:
        return None
    return stop_token_ids(len(tokenizer), tokenizer.eos_token_id, args.max_completion, args.work.mean_completion)


def skip_reason(backend: str, args) -> str | None:
    """Why a backend cannot run here, or None. Checked without importing: Unsloth patches on import."""
    return grpo_peers.skip_reason(backend, args)


def run_backend(backend: str, args, tokenizer, dataset, row: dict, deadline: float | None = None) -> None:
    """Train `backend` for args.steps steps (fewer if the deadline comes first); fills row as steps finish, so a
    failure keeps what was measured."""
    from transformers import PrinterCallback
    from trl import GRPOTrainer
    stats = GRPOStats(backend, path=args.out / f"{args.name}_{backend}.json", deadline=deadline, cuda=not args.tiny)
    row["per_step"] = stats.rows
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    stops = stop_ids(args, tokenizer)
    model = build(args, tokenizer, stops, args.model)
    rng = torch.get_rng_state()     # the trainer's LoRA init draws from it: equal for every backend
    common = dict(model=model, reward_funcs=REWARDS, train_dataset=dataset, processing_class=tokenizer,
                  callbacks=[stats], peft_config=lora_config())
    trainer, last, work = None, None, args.work
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if backend == "cb_sync":
                from cb_sync import CBConfig
                from cb_sync.integrations.trl import CBSyncGRPOTrainer
                # one rollout = work.rollout requests: decode graphs are captured for buckets up to it only
                cb_config = CBConfig(max_batch_size=work.rollout, max_batch_tokens=args.cb_max_batch_tokens,
                                     compile=args.cb_compile, progress_bar=False,
                                     batch_invariant=args.cb_batch_invariant)
                row["cb_batch_invariant"] = args.cb_batch_invariant
                trainer = CBSyncGRPOTrainer(args=grpo_config(args, tmp, work), cb_config=cb_config,
                                            release_after_rollout=AUTO_ON_OFF[args.cb_release_cache],
                                            group_by_length=AUTO_ON_OFF[args.cb_group_by_length],
                                            compile_layers=args.cb_compile_layers, **common)
                row["cb_group_by_length"], row["cb_release_cache"] = trainer.group_by_length, args.cb_release_cache
                row["cb_compile_layers"] = args.cb_compile_layers
                last = LastRollout()
                trainer.add_callback(last)
                trainer._generate_single_turn = last.wrap(trainer._generate_single_turn)
            elif backend == "trl_generate":
                trainer = GRPOTrainer(args=grpo_config(args, tmp, work), **common)
            elif backend in grpo_peers.OWN_PROCESS:       # from a saved copy, as TRL + vLLM and Unsloth load it
                common["model"] = grpo_peers.save_model(model, tokenizer, Path(tmp) / "model")
                model = None
                gc.collect()
                torch.cuda.empty_cache()
                torch.set_rng_state(rng)
                if backend == "unsloth":
                    from benchmarks.grpo_unsloth import unsloth_trainer
                    trainer = unsloth_trainer(args, grpo_config(args, tmp, work), **common)
                else:
                    os.environ.update(grpo_peers.distributed_env())      # before the config starts accelerate
                    config = grpo_config(args, tmp, work, **grpo_peers.trl_vllm_kwargs(backend == "trl_vllm_sleep",
                                                                                       stops))
                    trainer = GRPOTrainer(args=config, **common)
                    llm = trainer.vllm_generation.llm
                    llm.generate = stats.sampled(llm.generate)           # the card's memory with the KV pool awake
            elif backend == "trl_cb":
                # TRL's default sizes transformers' KV cache to 50% of free device memory (of RAM on the CPU: slow)
                cb = {"num_blocks": 16, "max_batch_tokens": 512} if args.tiny else None
                trainer = GRPOTrainer(args=grpo_config(args, tmp, work, use_transformers_continuous_batching=True,
                                                       transformers_continuous_batching_config=cb), **common)
            else:
                raise ValueError(f"unknown backend {backend!r}")
            trainer.remove_callback(PrinterCallback)
            generate = trainer._generate if stops is None else stats.counted(trainer._generate)
            trainer._generate = stats.timed(generate)
            row["build_s"] = stats.extra["build_s"] = round(time.perf_counter() - start, 2)
            trainer.train()
            replay_facts(trainer, row, stats)      # before the driver-alone calls capture graphs of their own
            if last is not None and last.weights is not None:
                runs, same = driver_alone(trainer, last, cuda=not args.tiny)
                row["driver_alone_runs_s"] = stats.extra["driver_alone_runs_s"] = runs
                row["driver_alone_s"] = stats.extra["driver_alone_s"] = round(statistics.median(runs), 3)
                row["driver_alone_same_tokens"] = stats.extra["driver_alone_same_tokens"] = same
                row["last_rollout_s"] = stats.extra["last_rollout_s"] = round(stats.rows[-1]["gen_s"], 3)
            if backend in grpo_peers.VLLM_BACKENDS:
                row["weight_sync"] = stats.extra["weight_sync"] = grpo_peers.weight_sync_check(trainer, common["model"])
    finally:
        row["init_fingerprint"] = stats.extra["init_fingerprint"] = stats.init_fingerprint
        if stats.stopped_early:
            row["stopped_early"] = True
        if "cb_capture_s_total" not in row:
            replay_facts(trainer, row, stats)
        stats.write()
        del trainer, model


def replay_facts(trainer, row: dict, stats: GRPOStats) -> None:
    """cb_sync's decode-graph capture seconds so far and whether its decode step is compiled (other backends: none)."""
    replay = getattr(getattr(getattr(trainer, "_cb_driver", None), "runner", None), "replay", None)
    if replay is not None:
        row["cb_capture_s_total"] = stats.extra["cb_capture_s_total"] = round(replay.graphs.capture_seconds, 2)
        row["cb_compiled"] = stats.extra["cb_compiled"] = getattr(replay.forward, "active", False)


class LastRollout(TrainerCallback):
    """What repeating a CBSyncGRPOTrainer's last rollout takes: its prompt ids, completions and the RNG state its
    seeds were drawn from (`wrap` the trainer's `_generate_single_turn`), and the trainable weights the next rollout
    decodes with, copied to the host at the start of training and after each step (outside the steps' timing)."""

    def __init__(self):
        self.prompt_ids = self.completion_ids = self.rng = self.weights = None

    def wrap(self, generate_single_turn):
        def wrapper(prompt_ids, *args, **kwargs):
            self.prompt_ids, self.rng = [list(p) for p in prompt_ids], torch.get_rng_state()
            completions, logprobs = generate_single_turn(prompt_ids, *args, **kwargs)
            self.completion_ids = [list(c) for c in completions]
            return completions, logprobs
        return wrapper

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.weights = trainable_weights(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step < state.max_steps and not control.should_training_stop:
            self.weights = trainable_weights(model)


def trainable_weights(model) -> dict[str, torch.Tensor]:
    """Host copies of the model's trainable parameters."""
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters() if p.requires_grad}


def load_weights(model, weights: dict[str, torch.Tensor]) -> None:
    """Copy `weights` into the model's parameters in place (captured graphs keep their addresses)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)


def driver_alone(trainer, last: LastRollout, cuda: bool, calls: int = 2) -> tuple[list[float], bool]:
    """Seconds of each of `calls` calls of the trainer's cb_sync driver alone repeating the last rollout (its
    requests, weights and seeds), the KV cache released before each where the trainer releases it after a rollout
    (its graphs kept, as the trainer keeps them), and whether every call returned the rollout's tokens. The
    trained weights are put back after."""
    from cb_sync.integrations.trl import releases_cache
    driver, model, seconds, same = trainer.cb_driver, trainer.model, [], True
    trained = trainable_weights(model)
    load_weights(model, last.weights)
    try:
        for _ in range(calls):
            if releases_cache(trainer.release_after_rollout, driver.cache.nbytes):
                driver.release(keep_graphs=True)
            torch.set_rng_state(last.rng)
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            results = driver.generate(last.prompt_ids, trainer._cb_params, progress_bar=False)
            if cuda:
                torch.cuda.synchronize()
            seconds.append(round(time.perf_counter() - start, 3))
            same &= [r.token_ids for r in results] == last.completion_ids
    finally:
        load_weights(model, trained)
        driver.release()
    return seconds, same


def finish(row: dict, warmup: int) -> None:
    """Add the summary of the steps that finished (none: nothing to add)."""
    if row.get("per_step"):
        row.update(summarize(row["per_step"], warmup, row["batch"]))
        if row.get("driver_alone_s"):
            row["rollout_vs_driver"] = round(row["last_rollout_s"] / row["driver_alone_s"], 3)


def completion_tokens(step: dict, rollout: int) -> float | None:
    """Completion tokens of a step's rollout: the recorded lengths' sum, else TRL's mean length x rollout."""
    if step.get("completion_lens") is not None:
        return sum(step["completion_lens"])
    return None if step.get("completion_len") is None else step["completion_len"] * rollout


def length_summary(per_step: list[dict]) -> dict:
    """Mean, p50, p90 and max of every recorded completion length, and the mean of TRL's per-step clipped ratio."""
    lengths = sorted(n for r in per_step for n in r.get("completion_lens") or [])
    if not lengths:
        return {}
    clipped = [r["clipped_ratio"] for r in per_step if r.get("clipped_ratio") is not None]
    return {"len_count": len(lengths), "len_mean": round(statistics.mean(lengths), 1),
            "len_p50": statistics.median(lengths),
            "len_p90": lengths[min(len(lengths) - 1, math.ceil(0.9 * len(lengths)) - 1)], "len_max": lengths[-1],
            "clipped_share": round(statistics.mean(clipped), 4) if clipped else None}


def summarize(per_step: list[dict], warmup: int, rollout: int) -> dict:
    timed = per_step[warmup:] or per_step
    peaks = [r["peak_gib"] for r in timed if r.get("peak_gib") is not None]
    lengths = [r["completion_len"] for r in per_step if r.get("completion_len") is not None]
    cards = [r["card_gib"] for r in timed if r.get("card_gib") is not None]
    gap_means, gap_p95s, gap_maxes, outside, is_means, is_mins = (
        [r[key] for r in per_step if r.get(key) is not None]
        for key in ("logp_gap_mean", "logp_gap_p95", "logp_gap_max", "ratio_outside", "is_ratio_mean", "is_ratio_min"))
    tokens = [(completion_tokens(r, rollout), r["gen_s"]) for r in timed]
    rates = [n / seconds for n, seconds in tokens if n is not None and seconds > 0]
    return {"step_ms": round(1000 * statistics.median(r["step_s"] for r in timed), 1),
            "median_includes_warmup": not per_step[warmup:],
            "gen_ms": round(1000 * statistics.median(r["gen_s"] for r in timed), 1),
            "rollout_tok_s": round(statistics.median(rates), 1) if rates else None,
            "peak_gib": round(max(peaks), 2) if peaks else None,
            "card_gib": round(max(cards), 2) if cards else None,
            "timed_steps": len(timed),
            "mean_completion_len": round(statistics.mean(lengths), 1) if lengths else None,
            "logp_gap_mean": statistics.mean(gap_means) if gap_means else None,
            "logp_gap_max": max(gap_maxes, default=None),
            "logp_gap_p95": statistics.mean(gap_p95s) if gap_p95s else None,          # the steps' mean
            "ratio_outside": statistics.mean(outside) if outside else None,
            "is_ratio_mean": statistics.mean(is_means) if is_means else None,
            "is_ratio_min": min(is_mins, default=None), **length_summary(per_step)}

# -- main -------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny Qwen3, fp32")
    parser.add_argument("--workload", default="G", choices=list(WORKLOADS), help="what a step does (see above)")
    parser.add_argument("--model", default="qwen3-4b", choices=list(MODEL_CONFIGS), help="the model's shape")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (10; tiny G 3, tiny G2 2)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the medians (3; tiny 1)")
    parser.add_argument("--max-completion", type=int, default=None,
                        help="max_completion_length (G 512, G2 1024; tiny G 8, tiny G2 16)")
    parser.add_argument("--shots", type=int, nargs="+", default=None, metavar="N",
                        help="worked examples per prompt, or LO HI: a count drawn per prompt (G 6 -> 130 tokens; "
                             "G2 3 28 -> 77..505)")
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient (> 0 so that KL is logged)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kl-atol", type=float, default=1e-3, help="gate: absolute per-step KL tolerance")
    parser.add_argument("--kl-rtol", type=float, default=1.0, help="gate: KL tolerance relative to the reference")
    parser.add_argument("--cb-compile", action="store_true", help="torch.compile cb_sync's decode step")
    parser.add_argument("--cb-compile-layers", action="store_true",
                        help="CBSyncGRPOTrainer(compile_layers=True): the training step through compiled decoder "
                             "layers")
    parser.add_argument("--sdpa-cudnn", default="on", choices=["on", "off"],
                        help="cuDNN attention in the trainers' SDPA forward and backward (PyTorch's choice on Hopper; "
                             "off: flash), for every backend: cuDNN builds kernels for each new sequence length")
    parser.add_argument("--cb-max-batch-tokens", type=int, default=None,
                        help="CBConfig.max_batch_tokens (G 512, G2 2048)")
    parser.add_argument("--cb-release-cache", choices=list(AUTO_ON_OFF), default="auto",
                        help="CBSyncGRPOTrainer(release_after_rollout=None / True / False): free the KV cache after "
                             "each rollout (auto: where it is larger than 1 GiB)")
    parser.add_argument("--cb-group-by-length", choices=list(AUTO_ON_OFF), default="auto",
                        help="CBSyncGRPOTrainer(group_by_length=None / True / False): micro-batches of similar "
                             "lengths, logprob forwards without shared padding (auto: where TRL's settings allow it)")
    parser.add_argument("--cb-batch-invariant", action="store_true",
                        help="CBConfig(batch_invariant=True): cb_sync's rollouts and its trainer's logprobs bit-equal "
                             "(uncompiled: not with --cb-compile)")
    parser.add_argument("--logp-gap-tol", type=float, default=None,
                        help="gate: max |generator - trainer| logprob for cb_sync (1e-3 with --tiny; GPU: report only)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds for all backends together: each gets an equal share of what is left and stops "
                             "early (after >= 2 steps) when its next step would overrun it")
    parser.add_argument("--unsloth-site", default=grpo_peers.UNSLOTH_SITE,
                        help="Unsloth's own target directory (unsloth, unsloth_zoo, trl <= 1.15, datasets < 5)")
    parser.add_argument("--row-file", type=Path, default=None,
                        help="run the one backend given in this process and write its row to this file (how the "
                             "run starts the backends that need a process of their own)")
    parser.add_argument("--from-json", nargs="+", type=Path, default=None, metavar="FILE",
                        help="measure nothing: merge the rows of these runs' <name>.json (runs of one machine, in "
                             "several calls; an engine's first row that ran is kept) into <out>/<name>.json|md|png")
    parser.add_argument("--name", default="grpo")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.row_file is not None and len(args.backends) != 1:
        parser.error("--row-file takes one backend")
    if args.shots is not None and len(args.shots) > 2:
        parser.error("--shots takes N or LO HI")
    if args.logp_gap_tol is None and args.tiny:
        args.logp_gap_tol = 1e-3
    resolve(args)
    return args


def resolve(args) -> None:
    """args.work: the workload; the settings left unset take its values."""
    args.work = workload(args.workload, args.tiny)
    for key in ("steps", "warmup", "max_completion", "shots", "cb_max_batch_tokens"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(args.work, key))
    if isinstance(args.shots, list):
        args.shots = args.shots[0] if len(args.shots) == 1 else tuple(args.shots)


def evaluate_gates(args, rows: list[dict]) -> None:
    reference = next((r for r in rows if r["engine"] == REFERENCE and r.get("per_step")), None)
    kwargs = dict(reward_range=REWARD_RANGE, kl_rtol=args.kl_rtol, logp_gap_tol=args.logp_gap_tol)
    for r in rows:
        r.pop("gate", None)
        r.pop("gate_self", None)
        # a backend stopped by --time-limit is expected to have the steps it had time for
        kwargs["expected_steps"] = (len(r.get("per_step") or []) if r.get("stopped_early")
                                    else r.get("steps", args.steps))
        if r.get("per_step") and reference is not None and r is not reference:
            r["gate"] = compare(reference["per_step"], r["per_step"], args.kl_atol, **kwargs)
        elif r.get("per_step"):   # the reference itself, or no reference: the checks that need none
            r["gate_self"] = compare(r["per_step"], r["per_step"], args.kl_atol, **kwargs)


def versions() -> dict:
    """Versions of the training stack next to the torch/transformers/triton ones that write_results adds."""
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for package in ("trl", "peft", "accelerate", "datasets", "vllm", "unsloth", "unsloth_zoo"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = None
    return out


def save(args, rows: list[dict], prompt_len: int) -> None:
    if args.row_file is not None:       # a backend's own process: its row goes to the run that started it
        args.row_file.write_text(json.dumps(rows[0]))
        return
    evaluate_gates(args, rows)
    write_results(args.name, rows, report(args, rows, prompt_len), out_dir=args.out)
    plot(rows, args.out / f"{args.name}.png")


def merge_runs(args) -> list[dict]:
    """--from-json: one report of several runs' rows, gated together; the settings are the first row's."""
    rows: dict[str, dict] = {}
    for path in args.from_json:
        for row in json.loads(path.read_text()):
            row.setdefault("workload", "G")
            if row["engine"] not in rows or (row.get("per_step") and not rows[row["engine"]].get("per_step")):
                rows[row["engine"]] = row
    merged = list(rows.values())
    first = merged[0]
    args.steps, args.warmup, args.max_completion, args.beta = (first["steps"], first["warmup"], first["new_tokens"],
                                                               first["beta"])
    args.seed = first.get("seed", args.seed)
    differ = [k for k in ("workload", "model", "steps", "warmup", "new_tokens", "beta", "prompt_len", "seed",
                          "sdpa_cudnn") if len({r.get(k) for r in merged}) > 1]
    evaluate_gates(args, merged)
    text = report(args, merged, first["prompt_len"], sources=[str(p) for p in args.from_json], differ=differ)
    (args.out / f"{args.name}.json").write_text(json.dumps(merged, indent=1))
    (args.out / f"{args.name}.md").write_text(text)
    plot(merged, args.out / f"{args.name}.png")
    print(summary_table(merged))
    return merged


def settings(args, tokenizer, dataset) -> dict:
    """The run's settings, in every row."""
    work = args.work
    lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in dataset["prompt"]]
    shape = "qwen3-tiny" if args.tiny else f"{args.model}-shape"
    out = {"workload": work.name, "model": shape, "lora": True, "batch": work.rollout,
           "num_generations": work.num_generations, "prompt_len": lengths[0], "new_tokens": args.max_completion,
           "steps": args.steps, "warmup": args.warmup, "beta": args.beta, "seed": args.seed}
    if args.sdpa_cudnn == "off":        # rows with the default keep the keys they had
        out["sdpa_cudnn"] = "off"
    if work.name != "G":     # G's rows keep the keys they had
        stops = stop_ids(args, tokenizer)
        out.update(prompts=work.prompts, micro_batch=work.micro_batch, shots=args.shots,
                   prompt_len_min=min(lengths), prompt_len_mean=round(statistics.mean(lengths), 1),
                   prompt_len_max=max(lengths), vocab=len(tokenizer), stop_tokens=len(stops or []),
                   target_mean_len=work.mean_completion, sampling=sampling(work))
    return {**out, **versions()}


def sampling(work: Workload) -> dict:
    """temperature, top_p, top_k and min_p as the workload sets them, else as GRPOConfig's defaults have them."""
    from trl import GRPOConfig
    fields = GRPOConfig.__dataclass_fields__
    return {k: work.sampling.get(k, fields[k].default) for k in ("temperature", "top_p", "top_k", "min_p")}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.enable_cudnn_sdp(args.sdpa_cudnn == "on")
    if args.from_json:
        return merge_runs(args)
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --tiny for the CPU smoke run)")
    tokenizer = make_tokenizer(512 if args.tiny else 151936)
    dataset = make_dataset(n=args.work.dataset_size, shots=args.shots, seed=args.seed)
    base = settings(args, tokenizer, dataset)
    prompt_len = base["prompt_len"]
    print(f"GRPO benchmark: {base}", flush=True)

    rows: list[dict] = []
    start = time.perf_counter()
    runnable = [b for b in args.backends if skip_reason(b, args) is None]
    try:
        for backend in args.backends:
            row = {"engine": backend, **base}
            rows.append(row)
            reason = skip_reason(backend, args)
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
                if backend in grpo_peers.OWN_PROCESS and args.row_file is None:
                    grpo_peers.run_own_process(backend, args, row, deadline, time.perf_counter())
                else:
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
