"""Workloads G and G2: GRPO steps on the Qwen3-4B shape (--model qwen3-1.7b: the 1.7B one) with LoRA r32, cb_sync's
trainer against TRL's own generation paths and Unsloth, one backend after the other on one card.

    python -m benchmarks grpo [--workload G|G2] [--model qwen3-4b|qwen3-1.7b] [--backends cb_sync_compiled ...]
        [--steps 10] [--warmup 3] [--time-limit S] [--name grpo_g] [--out DIR] [cb_sync's trainer options]
    python -m benchmarks grpo --backends cb_sync_compiled --synthetic-rollouts   # the training half alone
    python -m benchmarks grpo --backends cb_sync_compiled --ranks 1 2           # data parallel (accelerate launch)
    python -m benchmarks grpo --backends cb_sync_compiled --steps 100           # a soak: drift, GC pauses
    python -m benchmarks grpo --isolate --backends cb_sync_compiled --warm-rerun  # first steps, cold and warm caches
    python -m benchmarks grpo --backends cb_sync_exact --profile-step 5          # where step 5's time goes
    python -m benchmarks grpo --from-json A.json B.json --name NAME              # merge the rows of several runs
    python -m benchmarks grpo --tiny --out DIR                                   # CPU plumbing

Backends: cb_sync, cb_sync_compiled, cb_sync_exact (CBSyncGRPOTrainer with cb_sync's modes: uncompiled, decode step
compiled, CBConfig(batch_invariant=True)); trl_generate (TRL's HF `generate` path: the gate's reference); trl_cb
(TRL's transformers continuous batching); trl_vllm (TRL + vLLM colocate, TRL's defaults), trl_vllm_sleep (the same
with vLLM's sleep mode) and unsloth (Unsloth's GRPO path, fast_inference=False, its own TRL from --unsloth-site),
those three in processes of their own from a saved copy of the model (benchmarks.peers). Every backend trains a fresh
copy of the same random model (seed 0; the trainer adds LoRA r32 with lora_B = 0, so the KL reference is the base
model and every backend starts from the same weights) on the same synthetic math prompts with the same GRPOConfig.
A backend that cannot run has a row saying why; results are rewritten after every backend; SIGINT keeps what was
measured.

G: a step is one rollout of 1 prompt x 4 completions of 512 tokens (the prompt 130 tokens, 6 worked examples),
temperature 0.1, top_p 0.97, min_p 0.5, top_k 5; EOS silenced (its row of the tied output embedding zeroed, so its
logit is 0, never in the top 5 of 151,936 random logits). G2: one rollout of 8 prompts x 8 completions (TRL's
generation batch), trained in 4 micro-batches of 16; prompts of 77..505 tokens; up to 1,024 new tokens with EOS
live: the stop tokens are EOS and the top ids of the vocabulary, as many as make random logits at temperature 1 stop
with a capped geometric length of mean 400 (342 of 151,936); TRL's default sampling. Both: beta 0.04, lr 5e-6; a
token-parity reward gives every group some variance.

cb_sync's rows add the driver alone repeating the last rollout (its requests, seeds and the weights it decoded
with; the KV cache released before each of 2 calls where the trainer released it): `driver_alone_s`, whether the
tokens came back the same and `rollout_vs_driver`. --synthetic-rollouts replaces every rollout with random
completions of the workload's lengths (the same for every run): the training half alone, for A/Bs of the trainer's
options on the same rows. --ranks N: each rank trains a replica on its own GPU with the workload's load (N x the
prompts a step), gradients averaged by DDP; a row each N (steps: the slowest rank).

Every row has the time to its first optimizer step's end from its process's start (`first_step_s`; from the
backend's own start where another backend ran before it in the process: --isolate gives each its own), the drift
from its first to its last --drift-window timed steps, and the garbage collector's runs in each step and between
steps. --warm-rerun starts the run's processes on empty Inductor and Triton caches of its own and runs cb_sync's
modes once more at the end, on the caches their first run left.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from transformers import TrainerCallback

from benchmarks import peers
from benchmarks.grpo_stats import (REFERENCE, GRPOStats, compare, fingerprint, gate_lines, plot, report, soak_fields,
                                   summary_table)
from benchmarks.harness import (CB_MODES, RESULTS, SHAPES, TOKENIZER_WORDS, build_model, cb_config, free_cached_memory,
                                gc_pauses, lora_config, make_tokenizer, mode_flags, profiled, read_rows, run_child,
                                since_process_start, write_results)

OUT = RESULTS / "grpo"
IN_PROCESS = (*CB_MODES, "trl_generate", "trl_cb")
BACKENDS = (*IN_PROCESS, *peers.GRPO_PEERS)
DEFAULT_BACKENDS = ("cb_sync_compiled", "trl_generate", "trl_cb", *peers.GRPO_PEERS)
AUTO_ON_OFF = {"auto": None, "on": True, "off": False}      # the trainer's group_by_length, release_after_rollout


@dataclasses.dataclass(frozen=True)
class Workload:
    """A step: one rollout of prompts x num_generations completions, trained in micro-batches of micro_batch.
    shots: worked examples a prompt, or a (lo, hi) range drawn per prompt; sampling: GRPOConfig's fields ({}: TRL's
    defaults); mean_completion: None silences EOS, a number makes it live with as many stop tokens as give that mean."""

    name: str
    prompts: int
    num_generations: int
    micro_batch: int
    max_completion: int
    shots: int | tuple[int, int]
    sampling: dict
    mean_completion: float | None
    cb_max_batch_tokens: int
    dataset_size: int
    steps: int
    warmup: int

    @property
    def rollout(self) -> int:
        return self.prompts * self.num_generations


G = Workload("G", 1, 4, 4, 512, 6, dict(temperature=0.1, top_p=0.97, min_p=0.5, top_k=5), None, 512, 64, 10, 3)
G2 = Workload("G2", 8, 8, 16, 1024, (3, 28), {}, 400, 2048, 128, 10, 3)
WORKLOADS = {"G": (G, dataclasses.replace(G, max_completion=8, steps=3, warmup=1)),
             "G2": (G2, dataclasses.replace(G2, prompts=2, num_generations=4, micro_batch=4, max_completion=16,
                                            mean_completion=8, steps=2, warmup=1))}


def stop_probability(max_len: int, mean: float) -> float:
    """The per-token stop probability p whose geometric length law capped at max_len has this mean:
    (1 - (1 - p)^max_len) / p = mean (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(100):
        p = (lo + hi) / 2
        lo, hi = (p, hi) if (1 - (1 - p) ** max_len) / p > mean else (lo, p)
    return (lo + hi) / 2


def stop_token_ids(vocab_size: int, eos_token_id: int, max_len: int, mean: float) -> list[int]:
    """EOS and the top ids of the vocabulary, round(p x vocab_size) in all: under random weights their output rows
    are ordinary rows, so at temperature 1 a token stops with probability ~p."""
    count = round(stop_probability(max_len, mean) * vocab_size)
    return [eos_token_id] + list(range(vocab_size - count + 1, vocab_size))


def make_dataset(n: int = 64, shots: int | tuple[int, int] = 6, seed: int = 0):
    """n few-shot two-digit sums (29 + 16..17 tokens a shot; 130 tokens at 6 shots). The fingerprint is given, not
    hashed: hashing the table pickles pyarrow types, which fails with some pyarrow / Python pairs."""
    from datasets import Dataset
    from datasets.table import InMemoryTable
    rng = random.Random(seed)
    digits = lambda n: " ".join(str(n))    # noqa: E731
    head = "Solve the sum . Think between <think> and </think> , then answer between <answer> and </answer> ."
    prompts, answers = [], []
    for _ in range(n):
        parts = [head]
        for _ in range(shots if isinstance(shots, int) else rng.randint(*shots)):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            parts.append(f"Q : What is {digits(a)} + {digits(b)} ? A : <answer> {digits(a + b)} </answer>")
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        parts.append(f"Q : What is {digits(a)} + {digits(b)} ? A :")
        prompts.append(" ".join(parts))
        answers.append(digits(a + b))
    tag = str(shots) if isinstance(shots, int) else f"{shots[0]}to{shots[1]}"
    return Dataset(InMemoryTable.from_pydict({"prompt": prompts, "answer": answers}),
                   fingerprint=f"cb-sync-grpo-sums-{n}-{tag}-{seed}")


# -- rewards in the style of the GRPO notebooks, each with its range for the gate ---------------------------------

TAGS = TOKENIZER_WORDS[3:7]
MATCH_FORMAT = re.compile(r"</think>.*?<answer>\s*(.+?)\s*</answer>", re.DOTALL)
ANSWER = re.compile(r"<answer>\s*(.+?)\s*</answer>", re.DOTALL)


def _ranged(lo: float, hi: float):
    def mark(fn):
        fn.reward_range = (lo, hi)
        return fn
    return mark


@_ranged(0.0, 3.0)
def match_format_exactly(completions, **kwargs) -> list[float]:
    return [3.0 if MATCH_FORMAT.search(c) else 0.0 for c in completions]


@_ranged(-2.0, 2.0)
def match_format_approximately(completions, **kwargs) -> list[float]:
    return [sum(0.5 if c.count(tag) == 1 else -0.5 for tag in TAGS) for c in completions]


@_ranged(-1.0, 5.0)
def check_answer(completions, answer, **kwargs) -> list[float]:
    found = [ANSWER.search(c) for c in completions]
    return [0.0 if f is None else 5.0 if f.group(1).split() == a.split() else -1.0 for f, a in zip(found, answer)]


@_ranged(0.0, 1.0)
def even_token_fraction(completion_ids, **kwargs) -> list[float]:
    """Varies between the samples of a group under random weights: the advantages are not zero."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


REWARDS = [match_format_exactly, match_format_approximately, check_answer, even_token_fraction]
REWARD_RANGE = (sum(f.reward_range[0] for f in REWARDS), sum(f.reward_range[1] for f in REWARDS))


# -- one backend --------------------------------------------------------------------------------------------------

def build(args, tokenizer, stops: list[int] | None):
    """The random model (seed 0) with EOS silenced or, given `stops`, these as its EOS ids."""
    model = build_model(lora=False, tiny=args.tiny, shape=args.model)
    if stops is None:
        with torch.no_grad():   # the logit of EOS is 0: never among the top 5 of the random logits
            model.get_output_embeddings().weight[tokenizer.eos_token_id].zero_()
    for config in (model.config, model.generation_config):   # agree with the tokenizer (else transformers warns)
        config.eos_token_id, config.bos_token_id = stops or tokenizer.eos_token_id, tokenizer.bos_token_id
        config.pad_token_id = tokenizer.pad_token_id
    return model


# TRL 1.16's GRPOConfig defaults, given explicitly to every backend: Unsloth's patched GRPOConfig (unsloth/models/rl.py)
# has other defaults for these fields, and every backend must train alike. epsilon_high: TRL's None means epsilon
# (0.2), and an explicit loss_type makes Unsloth's None 0.28 (and mask_truncated_completions True); generation_kwargs:
# TRL reads None and {} alike. router_aux_loss_coef (Unsloth 0.0, TRL None) weighs an MoE loss: the models are dense.
TRL_DEFAULTS = dict(
    optim="adamw_torch_fused", weight_decay=0.0, lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=1.0,
    loss_type="dapo", epsilon_high=0.2, mask_truncated_completions=False, vllm_importance_sampling_correction=True,
    fp16=False, logging_nan_inf_filter=True, torch_empty_cache_steps=None, per_device_eval_batch_size=8,
    eval_accumulation_steps=None, include_num_input_tokens_seen="no", auto_find_batch_size=False,
    dataloader_pin_memory=True, vllm_mode="colocate", generation_kwargs={})
TRL_SAMPLING = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0)   # under the workload's


def grpo_config(args, output_dir: str, **extra):
    from trl import GRPOConfig
    work = args.work
    fields = dict(
        output_dir=output_dir, num_generations=work.num_generations, per_device_train_batch_size=work.micro_batch,
        gradient_accumulation_steps=work.rollout // work.micro_batch, max_completion_length=args.max_completion,
        beta=args.beta, learning_rate=5e-6, logging_steps=1, report_to=[], max_steps=args.steps, seed=args.seed,
        data_seed=args.seed, save_strategy="no", bf16=not args.tiny, use_cpu=args.tiny, disable_tqdm=True,
        dataloader_num_workers=0)
    return GRPOConfig(**{**TRL_DEFAULTS, **TRL_SAMPLING, **work.sampling, **fields, **extra})


def stop_ids(args, tokenizer) -> list[int] | None:
    if args.work.mean_completion is None:
        return None
    return stop_token_ids(len(tokenizer), tokenizer.eos_token_id, args.max_completion, args.work.mean_completion)


def cb_trainer(backend: str, args, callbacks: list, **common):
    from cb_sync.integrations.trl import CBSyncGRPOTrainer
    config = cb_config(backend, max_batch_size=args.work.rollout, max_batch_tokens=args.cb_max_batch_tokens,
                       progress_bar=False)
    return CBSyncGRPOTrainer(args=grpo_config(args, common.pop("output_dir")), cb_config=config, callbacks=callbacks,
                             release_after_rollout=AUTO_ON_OFF[args.cb_release_cache],
                             group_by_length=AUTO_ON_OFF[args.cb_group_by_length],
                             compile_layers=args.cb_compile_layers, freeze_gc=args.cb_freeze_gc == "on", **common)


TRAINED_IN_THIS_PROCESS = []      # backends run_backend ran here: the first one's first step counts from process start


def run_backend(backend: str, args, tokenizer, dataset, row: dict, deadline: float | None = None) -> None:
    """Train `backend` for args.steps steps (fewer if the deadline comes first), filling row as steps finish; the time
    to its first step from the process's start (or, after another backend in this process, from its own start)."""
    from transformers import PrinterCallback
    from trl import GRPOTrainer
    began = 0.0 if not TRAINED_IN_THIS_PROCESS else since_process_start()
    TRAINED_IN_THIS_PROCESS.append(backend)
    rank = os.environ.get("RANK", "") if args.ranks_dir is not None else ""
    stats = GRPOStats(backend, path=(args.ranks_dir or args.out) / f"{args.name}_{backend}{rank}.json",
                      deadline=deadline, cuda=not args.tiny, verbose=rank in ("", "0"))
    row["per_step"] = stats.rows
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    stops = stop_ids(args, tokenizer)
    model = build(args, tokenizer, stops)
    rng = torch.get_rng_state()     # the trainer's LoRA init draws from it: the same for every backend
    common = dict(model=model, reward_funcs=REWARDS, train_dataset=dataset, processing_class=tokenizer,
                  peft_config=lora_config())
    trainer, calls, forwards = None, DriverCalls(), ForwardShapes()
    profile = [] if args.profile_step is None else [StepProfile(args.profile_step, args.out / f"{args.name}_{backend}"
                                                                f"{rank}_profile.txt", cuda=not args.tiny)]
    try:
        with tempfile.TemporaryDirectory() as tmp, forwards.watching():
            if backend in CB_MODES:
                trainer = cb_trainer(backend, args, [stats, calls, StopTogether(), *profile], output_dir=tmp,
                                     **common)
                row.update(cb_group_by_length=getattr(trainer, "group_by_length", None),
                           cb_release_cache=args.cb_release_cache, cb_compile_layers=args.cb_compile_layers,
                           cb_freeze_gc=args.cb_freeze_gc)
            elif backend in peers.GRPO_PEERS:       # from a saved copy, as TRL + vLLM and Unsloth load one
                common["model"] = peers.save_model(model, tokenizer, Path(tmp) / "model")
                model = None
                free_cached_memory()
                torch.set_rng_state(rng)
                trainer = peers.grpo_trainer(backend, args, grpo_config, tmp, stops, stats, **common)
            else:
                # TRL's default sizes transformers' KV cache to 50% of free memory (of RAM on the CPU: slow)
                cb = {"num_blocks": 16, "max_batch_tokens": 512} if args.tiny else None
                extra = (dict(use_transformers_continuous_batching=True, transformers_continuous_batching_config=cb)
                         if backend == "trl_cb" else {})
                trainer = GRPOTrainer(args=grpo_config(args, tmp, **extra), callbacks=[stats, *profile], **common)
            trainer.remove_callback(PrinterCallback)
            generate = trainer._generate if stops is None else stats.counted(trainer._generate)
            trainer._generate = stats.timed(generate)
            if args.synthetic_rollouts:
                trainer._generate_single_turn = SyntheticRollouts(args.work, args.max_completion, tokenizer, stops,
                                                                  args.seed)
            row["build_s"] = stats.extra["build_s"] = round(time.perf_counter() - start, 2)
            with calls.recording() if backend in CB_MODES else contextlib.nullcontext(), gc_pauses() as pauses:
                stats.pauses = pauses
                trainer.train()
            forwards.add_to(stats.rows)
            if calls.last is not None:
                runs, same = calls.driver_alone(trainer.model, cuda=not args.tiny)
                row.update(driver_alone_runs_s=runs, driver_alone_s=round(statistics.median(runs), 3),
                           driver_alone_same_tokens=same, last_rollout_s=round(stats.rows[-1]["gen_s"], 3))
            if backend in peers.VLLM_BACKENDS:
                row["weight_sync"] = peers.weight_sync_check(trainer, common["model"])
            if args.ranks_dir is not None:
                row["final_fingerprint"] = fingerprint(trainer.model)
    finally:
        row["init_fingerprint"] = stats.init_fingerprint
        if stats.rows:
            row.update(first_step_s=round(stats.rows[0]["at_s"] - began, 1),
                       first_step_from="backend start" if began else "process start")
        stats.extra.update({k: v for k, v in row.items() if k != "per_step"})
        if stats.stopped_early:
            row["stopped_early"] = True
        stats.write()
        del trainer, model


class DriverCalls(TrainerCallback):
    """Records, while `recording()`, the last call of cb_sync's driver (its requests, arguments, RNG state and
    tokens) and whether the driver was released after it, and (as a callback) the trainable weights the next
    rollout decodes with (host copies, taken outside the steps' timing). `driver_alone` repeats that call."""

    def __init__(self):
        self.last = self.release = self.weights = None

    def recording(self):
        from cb_sync import SyncCBDriver
        generate, release = SyncCBDriver.generate, SyncCBDriver.release

        def recorded_generate(driver, *args, **kwargs):
            state = torch.get_rng_state()
            results = generate(driver, *args, **kwargs)
            self.last, self.release = (driver, args, kwargs, state, [r.token_ids for r in results]), None
            return results

        def recorded_release(driver, *args, **kwargs):
            self.release = kwargs
            return release(driver, *args, **kwargs)
        return patched(SyncCBDriver, generate=recorded_generate, release=recorded_release)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.weights = trainable_weights(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step < state.max_steps and not control.should_training_stop:
            self.weights = trainable_weights(model)

    def driver_alone(self, model, cuda: bool, calls: int = 2) -> tuple[list[float], bool]:
        """Seconds of `calls` repeats of the last driver call with its weights and seeds (the trained weights put
        back after), and whether each gave the rollout's tokens."""
        driver, args, kwargs, state, tokens = self.last
        trained = trainable_weights(model)
        load_weights(model, self.weights)
        seconds, same = [], True
        try:
            for _ in range(calls):
                if self.release is not None:
                    driver.release(**self.release)
                torch.set_rng_state(state)
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                results = driver.generate(*args, **{**kwargs, "progress_bar": False})
                if cuda:
                    torch.cuda.synchronize()
                seconds.append(round(time.perf_counter() - start, 3))
                same &= [r.token_ids for r in results] == tokens
        finally:
            load_weights(model, trained)
            driver.release()
        return seconds, same


@contextlib.contextmanager
def patched(target, **attributes):
    """`target`'s attributes set for a `with` block, restored after."""
    saved = {name: getattr(target, name) for name in attributes}
    for name, value in attributes.items():
        setattr(target, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(target, name, value)


def trainable_weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters() if p.requires_grad}


def load_weights(model, weights: dict[str, torch.Tensor]) -> None:
    """In place: captured graphs keep their addresses."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)


class ForwardShapes:
    """The [rows, width] of every TRL logprob forward while `watching()` (the exact mode's policy forwards are its
    own: only its reference forward is seen); `add_to(steps)` adds each step's forward tokens and widths."""

    def __init__(self):
        self.shapes: list[tuple[int, tuple[int, int]]] = []
        self.step = 0

    def watching(self):
        from trl import GRPOTrainer
        forward = GRPOTrainer._get_per_token_logps_and_entropies

        def recording(trainer, model, input_ids, *args, **kwargs):
            self.shapes.append((trainer.state.global_step + 1, tuple(input_ids.shape)))
            return forward(trainer, model, input_ids, *args, **kwargs)
        return patched(GRPOTrainer, _get_per_token_logps_and_entropies=recording)

    def add_to(self, steps: list[dict]) -> None:
        for step in steps:
            shapes = [shape for at, shape in self.shapes if at == step["step"]]
            step.update(forward_tokens=sum(r * w for r, w in shapes), forward_widths=sorted({w for _, w in shapes}))


class SyntheticRollouts:
    """Stands in for the trainer's `_generate_single_turn`: random completions whose lengths follow the workload's
    law (ending with EOS unless clipped), drawn from one seeded stream, and -1.0 logprobs."""

    def __init__(self, work: Workload, max_len: int, tokenizer, stops: list[int] | None, seed: int):
        self.rng, self.max_len, self.eos = random.Random(seed), max_len, tokenizer.eos_token_id
        self.stop_p = None if work.mean_completion is None else stop_probability(max_len, work.mean_completion)
        stops = set(stops or [])
        self.tokens = [t for t in range(len(tokenizer.all_special_ids) + 8, len(tokenizer)) if t not in stops]

    def length(self) -> int:
        if self.stop_p is None:
            return self.max_len
        return min(self.max_len, 1 + int(math.log(1.0 - self.rng.random()) / math.log(1.0 - self.stop_p)))

    def __call__(self, prompt_ids, *args, **kwargs):
        completions = []
        for _ in prompt_ids:
            n = self.length()
            completions.append([self.rng.choice(self.tokens) for _ in range(n)])
            if n < self.max_len:
                completions[-1][-1] = self.eos          # stopped: ends with a stop token, as a sample would
        return completions, [[-1.0] * len(ids) for ids in completions]


class StepProfile(TrainerCallback):
    """Optimizer step `step` (1-based: its rollout, forwards, backward and optimizer step) under `harness.profiled`,
    its table written to path."""

    def __init__(self, step: int, path: Path, cuda: bool):
        self.step, self.path, self.cuda, self.block = step, path, cuda, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step and self.block is None:
            self.block = profiled(self.path, self.cuda)
            self.block.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.block is not None:
            block, self.block = self.block, None
            block.__exit__(None, None, None)


class StopTogether(TrainerCallback):
    """Under DDP every rank stops after the step at which any rank's time share ran out (equal step counts)."""

    def on_step_end(self, args, state, control, **kwargs):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            flag = torch.tensor([float(control.should_training_stop)], device=args.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            control.should_training_stop = bool(flag.item())


# -- rows ---------------------------------------------------------------------------------------------------------

def summarize(row: dict, warmup: int, drift_window: int = 10) -> None:
    """Add the medians (without the warm-up steps) of the steps that finished, their drift and the garbage
    collector's runs (`soak_fields`); none: nothing to add."""
    steps = row.get("per_step")
    if not steps:
        return
    timed = steps[warmup:] or steps
    lengths = sorted(n for s in steps for n in s.get("completion_lens") or [])
    tokens = [(sum(s["completion_lens"]) if s.get("completion_lens") else (s.get("completion_len") or 0)
               * row["batch"], s["gen_s"]) for s in timed]
    rates = [n / s for n, s in tokens if n and s > 0]
    values = lambda key: [s[key] for s in steps if s.get(key) is not None]   # noqa: E731
    row.update(step_ms=round(1000 * statistics.median(s["step_s"] for s in timed), 1),
               gen_ms=round(1000 * statistics.median(s["gen_s"] for s in timed), 1),
               rollout_tok_s=round(statistics.median(rates), 1) if rates else None,
               peak_gib=max((s["peak_gib"] for s in timed if s.get("peak_gib") is not None), default=None),
               card_gib=max((s["card_gib"] for s in timed if s.get("card_gib") is not None), default=None),
               timed_steps=len(timed), mean_completion_len=round(statistics.mean(values("completion_len")), 1)
               if values("completion_len") else None,
               logp_gap_mean=statistics.mean(values("logp_gap_mean")) if values("logp_gap_mean") else None,
               logp_gap_p95=statistics.mean(values("logp_gap_p95")) if values("logp_gap_p95") else None,
               logp_gap_max=max(values("logp_gap_max"), default=None),
               ratio_outside=statistics.mean(values("ratio_outside")) if values("ratio_outside") else None,
               is_ratio_mean=statistics.mean(values("is_ratio_mean")) if values("is_ratio_mean") else None,
               is_ratio_min=min(values("is_ratio_min"), default=None))
    for key in ("peak_gib", "card_gib"):
        row[key] = None if row[key] is None else round(row[key], 2)
    if lengths:
        row.update(len_count=len(lengths), len_mean=round(statistics.mean(lengths), 1),
                   len_p50=statistics.median(lengths), len_max=lengths[-1],
                   len_p90=lengths[min(len(lengths) - 1, math.ceil(0.9 * len(lengths)) - 1)])
    row.update(soak_fields(steps, warmup, drift_window))
    if row.get("driver_alone_s"):
        row["rollout_vs_driver"] = round(row["last_rollout_s"] / row["driver_alone_s"], 3)
    if "ranks" in row:
        row["completions_per_s"] = round(row["ranks"] * row["batch"] * 1000 / row["step_ms"], 3)


def merge_ranks(rows: list[dict]) -> dict:
    """One row of an N-rank run from its ranks' rows: a step's times the slowest rank's, the rest rank 0's."""
    first, steps = rows[0], min(len(r.get("per_step") or []) for r in rows)
    merged = {**first, "per_step": [{**first["per_step"][i],
                                     **{k: max(r["per_step"][i][k] for r in rows) for k in ("step_s", "gen_s")}}
                                    for i in range(steps)]}
    finals = [json.dumps(r.get("final_fingerprint"), sort_keys=True) for r in rows]
    merged["replicas_equal"] = len(set(finals)) == 1 and "null" not in finals
    merged["peak_gib_per_rank"] = [max((s["peak_gib"] or 0 for s in r.get("per_step") or []), default=None)
                                   for r in rows]
    errors = [r["error"] for r in rows if r.get("error")]
    if errors:
        merged["error"] = errors[0]
    return merged


def run_ranks(backend: str, ranks: int, args, row: dict, deadline: float | None) -> None:
    """The backend on `ranks` processes (accelerate launch, DDP), each writing its row; merged into row."""
    ranks_dir = Path(tempfile.mkdtemp(prefix="grpo_ranks_"))
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(ranks),
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "benchmarks.grpo"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                     os.environ.get("PYTHONPATH")]))}
    left = None if deadline is None else deadline - time.perf_counter()
    if args.tiny:
        env["OMP_NUM_THREADS"] = "1"
    outcome = run_child([*launcher, *child_argv(args, backend, left), "--ranks-dir", str(ranks_dir)],
                        None if left is None else left + 240, env=env)
    got = [json.loads(p.read_text()) for p in sorted(ranks_dir.glob("rank*.json"))]
    shutil.rmtree(ranks_dir, ignore_errors=True)
    row.update(merge_ranks(got) if got else {"error": outcome.reason(left)})
    row["ranks"] = ranks


def child_argv(args, backend: str, time_limit: float | None) -> list[str]:
    """benchmarks.grpo's arguments for one backend in a process of its own (the run's settings)."""
    shots = [args.shots] if isinstance(args.shots, int) else list(args.shots)
    argv = ["--backends", backend, "--workload", args.workload, "--model", args.model, "--name", args.name,
            "--out", str(args.out), "--steps", str(args.steps), "--warmup", str(args.warmup), "--max-completion",
            str(args.max_completion), "--shots", *map(str, shots), "--beta", str(args.beta), "--seed", str(args.seed),
            "--kl-atol", str(args.kl_atol), "--kl-rtol", str(args.kl_rtol), "--sdpa-cudnn", args.sdpa_cudnn,
            "--drift-window", str(args.drift_window),
            "--unsloth-site", str(args.unsloth_site), "--cb-max-batch-tokens", str(args.cb_max_batch_tokens),
            "--cb-release-cache", args.cb_release_cache, "--cb-group-by-length", args.cb_group_by_length,
            "--cb-freeze-gc", args.cb_freeze_gc]
    argv += ["--tiny"] * args.tiny + ["--cb-compile-layers"] * args.cb_compile_layers
    argv += ["--synthetic-rollouts"] * args.synthetic_rollouts
    argv += [] if args.profile_step is None else ["--profile-step", str(args.profile_step)]
    return argv + ([] if time_limit is None else ["--time-limit", f"{max(time_limit, 1.0):.0f}"])


# -- the run ------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU plumbing: the tiny model, fp32, a few tokens")
    parser.add_argument("--workload", default="G", choices=list(WORKLOADS))
    parser.add_argument("--model", default="qwen3-4b", choices=[s for s in SHAPES if s != "tiny"])
    parser.add_argument("--backends", nargs="+", default=None, choices=list(BACKENDS))
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (10; tiny G 3, tiny G2 2)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the medians (3; tiny 1)")
    parser.add_argument("--max-completion", type=int, default=None, help="G 512, G2 1024 (tiny 8, 16)")
    parser.add_argument("--shots", type=int, nargs="+", default=None, metavar="N", help="N, or LO HI drawn a prompt")
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient (> 0: KL is logged and gated)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kl-atol", type=float, default=1e-3, help="gate: absolute per-step KL tolerance")
    parser.add_argument("--kl-rtol", type=float, default=1.0, help="gate: KL tolerance relative to the reference")
    parser.add_argument("--logp-gap-tol", type=float, default=None, help="gate: cb_sync's max logprob gap (tiny 1e-3)")
    parser.add_argument("--sdpa-cudnn", default="on", choices=["on", "off"], help="cuDNN attention in SDPA")
    parser.add_argument("--cb-max-batch-tokens", type=int, default=None, help="CBConfig.max_batch_tokens (512, 2048)")
    parser.add_argument("--cb-release-cache", choices=list(AUTO_ON_OFF), default="auto",
                        help="release_after_rollout None / True / False")
    parser.add_argument("--cb-group-by-length", choices=list(AUTO_ON_OFF), default="auto",
                        help="group_by_length None / True / False")
    parser.add_argument("--cb-compile-layers", action="store_true", help="CBSyncGRPOTrainer(compile_layers=True)")
    parser.add_argument("--cb-freeze-gc", choices=["on", "off"], default="off", help="CBSyncGRPOTrainer(freeze_gc=...)")
    parser.add_argument("--synthetic-rollouts", action="store_true", help="random completions: the training half")
    parser.add_argument("--profile-step", type=int, default=None, metavar="N",
                        help="step N under torch.profiler (cb_sync and TRL's in-process paths): its busiest kernels "
                             "in <out>/<name>_<backend>_profile.txt (its time, slowed, counts in the medians)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1], help="processes (GPUs) a cb_sync run, in turn")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds for all backends: each gets an equal share of what is left")
    parser.add_argument("--isolate", action="store_true", help="every backend in a process of its own (the peers are)")
    parser.add_argument("--warm-rerun", action="store_true",
                        help="cb_sync's modes from empty compile caches, then once more with the caches they left")
    parser.add_argument("--drift-window", type=int, default=10, help="timed steps compared at each end of a run")
    parser.add_argument("--unsloth-site", default=peers.UNSLOTH_SITE, help="Unsloth's own target directory")
    parser.add_argument("--from-json", nargs="+", type=Path, default=None, metavar="FILE", help="merge runs' rows")
    parser.add_argument("--row-file", type=Path, default=None, help=argparse.SUPPRESS)     # a backend's own process
    parser.add_argument("--ranks-dir", type=Path, default=None, help=argparse.SUPPRESS)    # a rank of --ranks N
    parser.add_argument("--name", default=None, help="result files <out>/<name>.json|md|png (grpo_<workload>)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    args.work = WORKLOADS[args.workload][args.tiny]
    for key in ("steps", "warmup", "max_completion", "shots", "cb_max_batch_tokens"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(args.work, key))
    if isinstance(args.shots, list):
        args.shots = args.shots[0] if len(args.shots) == 1 else tuple(args.shots[:2])
    if args.logp_gap_tol is None and args.tiny and not args.synthetic_rollouts:   # synthetic logprobs are -1
        args.logp_gap_tol = 1e-3
    args.backends = args.backends or [("cb_sync" if args.tiny and b in CB_MODES else b) for b in DEFAULT_BACKENDS]
    args.name = args.name or f"grpo_{args.workload.lower()}"
    return args


def settings(args, tokenizer, dataset) -> dict:
    """The run's settings, in every row."""
    work = args.work
    lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in dataset["prompt"]]
    return {"workload": work.name, "model": "qwen3-tiny" if args.tiny else f"{args.model}-shape", "lora": True,
            "batch": work.rollout, "prompts": work.prompts, "num_generations": work.num_generations,
            "micro_batch": work.micro_batch, "prompt_len": lengths[0], "prompt_len_min": min(lengths),
            "prompt_len_max": max(lengths), "new_tokens": args.max_completion, "shots": args.shots,
            "stop_tokens": len(stop_ids(args, tokenizer) or []), "vocab": len(tokenizer),
            "sampling": {k: work.sampling.get(k, TRL_SAMPLING[k]) for k in ("temperature", "top_p", "top_k", "min_p")},
            "steps": args.steps, "warmup": args.warmup, "beta": args.beta, "seed": args.seed,
            "sdpa_cudnn": args.sdpa_cudnn, "synthetic_rollouts": args.synthetic_rollouts}


def describe(rows: list[dict]) -> tuple[str, str]:
    """The report's title and what a step of its workload does."""
    first = rows[0]
    sampling = ", ".join(f"{k} {v}" for k, v in first["sampling"].items())
    eos = (f"{first['stop_tokens']} stop tokens (EOS live)" if first["stop_tokens"] else "EOS silenced")
    title = f"# Workload {first['workload']} (GRPO): {first['model']}, LoRA r32 on all 7 projections"
    text = (f"{first['steps']} steps ({first['warmup']} warm-up, left out of the medians). A step: one rollout of "
            f"{first['prompts']} prompts x {first['num_generations']} generations, trained in "
            f"{first['batch'] // first['micro_batch']} micro-batches of {first['micro_batch']}; prompts of "
            f"{first['prompt_len_min']}..{first['prompt_len_max']} tokens; completions to {first['new_tokens']} "
            f"tokens, {eos}; sampling: {sampling}; beta {first['beta']}, seed {first['seed']}"
            + ("; rollouts replaced by synthetic completions (the training half alone)"
               if first.get("synthetic_rollouts") else "") + ". Step: optimizer step begin to end, the device "
            "synchronised; rollout: TRL's `_generate`; card GiB: the device's memory in use, every process and pool.")
    return title, text


def evaluate_gates(args, rows: list[dict]) -> None:
    reference = next((r for r in rows if r["engine"] == REFERENCE and r.get("per_step")), None)
    for r in rows:
        r.pop("gate", None)
        r.pop("gate_self", None)
        if not r.get("per_step"):
            continue
        expected = len(r["per_step"]) if r.get("stopped_early") else r.get("steps", args.steps)
        against = reference["per_step"] if reference is not None and r is not reference else r["per_step"]
        r["gate" if against is not r["per_step"] else "gate_self"] = compare(
            against, r["per_step"], args.kl_atol, reward_range=REWARD_RANGE, kl_rtol=args.kl_rtol,
            logp_gap_tol=args.logp_gap_tol, expected_steps=expected)


def save(args, rows: list[dict]) -> None:
    if args.row_file is not None:       # a backend's own process: its row goes to the run that started it
        args.row_file.write_text(json.dumps(rows[0]))
        return
    evaluate_gates(args, rows)
    write_results(args.name, rows, report(rows, *describe(rows)), args.out)
    plot(rows, args.out / f"{args.name}.png")


def merge_runs(args) -> list[dict]:
    """--from-json: one report of several runs' rows (a backend's first row that ran), gated together."""
    merged: dict[tuple, dict] = {}
    for row in read_rows(args.from_json):
        key = (row["engine"], row.get("ranks", 1), row.get("compile_caches"))
        if key not in merged or (row.get("per_step") and not merged[key].get("per_step")):
            merged[key] = row
    rows = list(merged.values())
    args.steps = rows[0]["steps"]
    save(args, rows)
    print(summary_table(rows))
    return rows


def jobs_of(args) -> list[tuple[str, int, str | None]]:
    """(backend, ranks, compile caches) of every job in turn. --warm-rerun: cb_sync's modes start from empty compile
    caches ("cold") and run once more at the end ("warm"), each in a process of its own."""
    cold = "cold" if args.warm_rerun else None
    jobs = [(b, n, cold if b in CB_MODES else None) for b in args.backends for n in (args.ranks if b in CB_MODES
                                                                                       else [1])]
    return jobs + [(b, 1, "warm") for b in args.backends if b in CB_MODES and args.warm_rerun]


@contextlib.contextmanager
def fresh_compile_caches(wanted: bool):
    """Inductor's and Triton's caches in a new directory for the block, which every child process inherits (the
    first process to compile starts cold, the next finds what it left); nothing where not wanted."""
    if not wanted:
        yield
        return
    root = Path(tempfile.mkdtemp(prefix="grpo_compile_caches_"))
    saved = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    os.environ.update(TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"), TRITON_CACHE_DIR=str(root / "triton"))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
        shutil.rmtree(root, ignore_errors=True)


def run(args, tokenizer, dataset, base: dict) -> list[dict]:
    jobs = jobs_of(args)
    runnable = [i for i, job in enumerate(jobs) if peers.skip_reason(job[0], args) is None]
    rows: list[dict] = []
    start = time.perf_counter()
    try:
        with fresh_compile_caches(args.warm_rerun and args.row_file is None):
            for i, (backend, ranks, caches) in enumerate(jobs):
                rows.append({"engine": backend, **base, **mode_flags(backend),
                             **({"ranks": ranks} if args.ranks != [1] else {}),
                             **({"compile_caches": caches} if caches else {})})
                reason = peers.skip_reason(backend, args)
                if reason is not None:
                    rows[-1]["skipped"] = reason
                    print(f"[{backend}] skipped: {reason}", flush=True)
                    continue
                deadline = None
                if args.time_limit is not None:   # an equal share of what is left to each job still to run
                    now = time.perf_counter()
                    deadline = now + (start + args.time_limit - now) / sum(j >= i for j in runnable)
                run_job(backend, ranks, caches, args, tokenizer, dataset, rows[-1], deadline)
                summarize(rows[-1], args.warmup, args.drift_window)
                if args.row_file is None and args.ranks_dir is None:
                    (args.out / f"{args.name}_{backend}.json").unlink(missing_ok=True)   # its steps are in the row
                free_cached_memory()
                save(args, rows)                     # after every backend: a run cut short keeps what it measured
    except KeyboardInterrupt:                    # e.g. `timeout -s INT`: keep what was measured, run nothing more
        if rows and "step_ms" not in rows[-1] and "skipped" not in rows[-1]:
            rows[-1].setdefault("error", "interrupted")
            summarize(rows[-1], args.warmup, args.drift_window)
        rows += [{"engine": b, **base, "skipped": "not reached: the run was interrupted"}
                 for b, _, _ in jobs[len(rows):]]
    return rows


def run_job(backend: str, ranks: int, caches: str | None, args, tokenizer, dataset, row: dict,
            deadline: float | None) -> None:
    """One job: on `ranks` processes, in a process of its own (the peers; every backend with --isolate; cb_sync's
    modes with --warm-rerun) or here; its failure is its row's error."""
    try:
        if ranks > 1:
            run_ranks(backend, ranks, args, row, deadline)
        elif args.row_file is None and (backend in peers.GRPO_PEERS or args.isolate or caches is not None):
            peers.run_grpo_peer(backend, child_argv(args, backend, None if deadline is None else
                                                    deadline - time.perf_counter()), args, row)
        else:
            run_backend(backend, args, tokenizer, dataset, row, deadline)
    except Exception as error:          # one failing backend must not stop the others
        traceback.print_exc()
        row["error"] = repr(error)[:2000]


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.enable_cudnn_sdp(args.sdpa_cudnn == "on")
    if args.from_json:
        return merge_runs(args)
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --tiny for the CPU plumbing)")
    tokenizer = make_tokenizer(512 if args.tiny else 151936)
    dataset = make_dataset(n=args.work.dataset_size, shots=args.shots, seed=args.seed)
    base = settings(args, tokenizer, dataset)
    if args.ranks_dir is not None:          # one rank of a data-parallel run: its row to the run that started it
        if not args.tiny:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))   # its replica on its own GPU
        row = {"engine": args.backends[0], **base}
        run_backend(args.backends[0], args, tokenizer, dataset, row, None if args.time_limit is None else
                    time.perf_counter() + args.time_limit)
        (args.ranks_dir / f"rank{os.environ.get('RANK', 0)}.json").write_text(json.dumps(row))
        return [row]
    rows = run(args, tokenizer, dataset, base)
    save(args, rows)
    print("\n" + summary_table(rows) + "\n" + "\n".join(gate_lines(rows)), flush=True)
    return rows


if __name__ == "__main__":
    main()
