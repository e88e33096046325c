"""Workload G: GRPO steps on the Qwen3-4B shape + LoRA r32, cb_sync against TRL's own generation paths.

Each backend trains a freshly built copy of the same model (same seed; the trainer adds LoRA r32 through
`peft_config`, lora_B = 0 as in the reference notebook, so the KL reference is the base model and every backend
starts from identical weights; GRPOStats fingerprints the trainable weights at train begin) on the same synthetic
math prompts with the same GRPOConfig (the reference notebook's shape: 4 generations, batch 4, temperature 0.1,
top_p 0.97, min_p 0.5, top_k 5), on one card, one after the other:
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

    python -m benchmarks.grpo [--tiny] [--backends cb_sync trl_generate trl_cb trl_vllm ...] [--steps 10]
                              [--warmup 3] [--max-completion 512] [--time-limit SECONDS] [--name grpo] [--out DIR]

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
import json
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks import grpo_peers
from benchmarks.common import RESULTS, build_model, write_results
from benchmarks.grpo_report import gate_lines, plot, report, summary_table
from benchmarks.grpo_stats import GRPOStats, compare
from benchmarks.grpo_workload import (GEN_BATCH, REFERENCE, REWARD_RANGE, REWARDS, lora_config, make_dataset,
                                      make_tokenizer)

BACKENDS = ("cb_sync", "trl_generate", "trl_cb", "trl_vllm", "trl_vllm_sleep", "unsloth")

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


def grpo_config(args, output_dir: str, **extra):
    from trl import GRPOConfig
    return GRPOConfig(
        output_dir=output_dir, num_generations=4, per_device_train_batch_size=GEN_BATCH, gradient_accumulation_steps=1,
        temperature=0.1, top_p=0.97, min_p=0.5, top_k=5, max_completion_length=args.max_completion,
        beta=args.beta, learning_rate=5e-6, logging_steps=1, report_to=[], max_steps=args.steps, seed=args.seed,
        data_seed=args.seed, save_strategy="no", bf16=not args.tiny, use_cpu=args.tiny, disable_tqdm=True,
        dataloader_num_workers=0, **extra)


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
    model = build(args, tokenizer)
    rng = torch.get_rng_state()     # the trainer's LoRA init draws from it: equal for every backend
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
            elif backend in grpo_peers.OWN_PROCESS:       # from a saved copy, as TRL + vLLM and Unsloth load it
                common["model"] = grpo_peers.save_model(model, tokenizer, Path(tmp) / "model")
                model = None
                gc.collect()
                torch.cuda.empty_cache()
                torch.set_rng_state(rng)
                if backend == "unsloth":
                    from benchmarks.grpo_unsloth import unsloth_trainer
                    trainer = unsloth_trainer(args, grpo_config(args, tmp), **common)
                else:
                    os.environ.update(grpo_peers.distributed_env())      # before the config starts accelerate
                    config = grpo_config(args, tmp, **grpo_peers.trl_vllm_kwargs(backend == "trl_vllm_sleep"))
                    trainer = GRPOTrainer(args=config, **common)
                    llm = trainer.vllm_generation.llm
                    llm.generate = stats.sampled(llm.generate)           # the card's memory with the KV pool awake
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
            if backend in grpo_peers.VLLM_BACKENDS:
                row["weight_sync"] = stats.extra["weight_sync"] = grpo_peers.weight_sync_check(trainer, common["model"])
    finally:
        row["init_fingerprint"] = stats.extra["init_fingerprint"] = stats.init_fingerprint
        if stats.stopped_early:
            row["stopped_early"] = True
        replay = getattr(getattr(getattr(trainer, "_cb_driver", None), "runner", None), "replay", None)
        if replay is not None:
            row["cb_capture_s_total"] = stats.extra["cb_capture_s_total"] = round(replay.graphs.capture_seconds, 2)
            row["cb_compiled"] = stats.extra["cb_compiled"] = getattr(replay.forward, "active", False)
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
    cards = [r["card_gib"] for r in timed if r.get("card_gib") is not None]
    gap_means, gap_maxes, is_means, is_mins = ([r[key] for r in per_step if r.get(key) is not None] for key in (
        "logp_gap_mean", "logp_gap_max", "is_ratio_mean", "is_ratio_min"))
    return {"step_ms": round(1000 * statistics.median(r["step_s"] for r in timed), 1),
            "median_includes_warmup": not per_step[warmup:],
            "gen_ms": round(1000 * statistics.median(r["gen_s"] for r in timed), 1),
            "peak_gib": round(max(peaks), 2) if peaks else None,
            "card_gib": round(max(cards), 2) if cards else None,
            "timed_steps": len(timed),
            "mean_completion_len": round(statistics.mean(lengths), 1) if lengths else None,
            "logp_gap_mean": statistics.mean(gap_means) if gap_means else None,
            "logp_gap_max": max(gap_maxes, default=None),
            "is_ratio_mean": statistics.mean(is_means) if is_means else None,
            "is_ratio_min": min(is_mins, default=None)}

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
        kwargs["expected_steps"] = len(r.get("per_step") or []) if r.get("stopped_early") else r.get("steps", args.steps)
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
            if row["engine"] not in rows or (row.get("per_step") and not rows[row["engine"]].get("per_step")):
                rows[row["engine"]] = row
    merged = list(rows.values())
    first = merged[0]
    args.steps, args.warmup, args.max_completion, args.beta = (first["steps"], first["warmup"], first["new_tokens"],
                                                               first["beta"])
    args.seed = first.get("seed", args.seed)
    differ = [k for k in ("steps", "warmup", "new_tokens", "beta", "prompt_len", "seed")
              if len({r.get(k) for r in merged}) > 1]
    evaluate_gates(args, merged)
    text = report(args, merged, first["prompt_len"], sources=[str(p) for p in args.from_json], differ=differ)
    (args.out / f"{args.name}.json").write_text(json.dumps(merged, indent=1))
    (args.out / f"{args.name}.md").write_text(text)
    plot(merged, args.out / f"{args.name}.png")
    print(summary_table(merged))
    return merged


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        return merge_runs(args)
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --tiny for the CPU smoke run)")
    tokenizer = make_tokenizer(512 if args.tiny else 151936)
    dataset = make_dataset(n=64, shots=args.shots, seed=args.seed)
    prompt_len = len(tokenizer(dataset[0]["prompt"], add_special_tokens=False)["input_ids"])
    base = {"model": "qwen3-tiny" if args.tiny else "qwen3-4b-shape", "lora": True, "batch": GEN_BATCH,
            "num_generations": 4, "prompt_len": prompt_len, "new_tokens": args.max_completion, "steps": args.steps,
            "warmup": args.warmup, "beta": args.beta, "seed": args.seed, **versions()}
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
