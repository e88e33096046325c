"""The training half of a GRPO step alone: CBSyncGRPOTrainer on Workload G or G2 with every rollout replaced by
synthetic completions (random tokens, lengths drawn from the workload's law with a fixed seed), so that variants of
the trainer's side train on the very same rows and their A/B is not lost in the spread of sampled lengths and of the
rollouts (G2 at 4B: training per completion token differed by ~20% between two runs of the same code).

    python -m benchmarks.grpo_training [--tiny] [--workload G2] [--model qwen3-4b] [--steps 6] [--warmup 2]
        [--variants grouped width1 ungrouped no_cudnn no_warmup] [--profile-step K [--keep-trace]]
        [--name grpo_training] [--out DIR]

Variants (each trains a freshly built model with the same seed, in this process, one after the other):
    grouped    the default trainer: micro-batches grouped by length, each forward trimmed of its shared padding and
               left-padded to a multiple of `length_groups.WIDTH_MULTIPLE` columns
    width1     grouped, forwards as trimmed (no widening: a new width in nearly every forward)
    ungrouped  TRL's micro-batches (group_by_length=False)
    no_cudnn   grouped, with cuDNN attention off in SDPA (PyTorch then takes flash or memory-efficient attention)
    no_warmup  grouped, without the trainer's attention warm-up at each variety's first forward (`attention_warmup`)
    compiled   grouped, with GRPOConfig(torch_compile=True): the trainer's model wrapped in torch.compile
    input_casts grouped, with PEFT's cast of LoRA inputs to the adapter dtype kept (`lora_input_casts`)
    compiled_layers grouped, with each decoder layer compiled (CBSyncGRPOTrainer(compile_layers=True))
    batch_invariant the trainer's forwards in batch-invariant mode (CBConfig(batch_invariant=True); TRL's micro-batches)
    batch_invariant_m64 batch_invariant, the LoRA kernel's fixed tiling in 64 x 64 x 64 tiles (LoraTuning)

A step is timed from TRL's step begin to its end: the reference forward, each micro-batch's loss forward, recompute
and backward, the optimizer (the synthetic rollout itself takes about a millisecond). G2's completions follow its
capped geometric law (mean 400, at most 1,024) and end with a stop token unless clipped; G's run to its
max_completion_length. The prompts are the workload's own. Per step the rows record the real tokens (prompts and
completions), the tokens the logprob forwards were given (padding included; gradient checkpointing's recompute not
counted) and their widths.

Writes <out>/<name>.json and <name>.md: per variant the median step, ms per 1k completion tokens, forward tokens over
real tokens, distinct forward widths, peak memory (torch) and the steps whose gradient norm was not finite.
--profile-step K: torch.profiler tables of each variant's step K in <out>/<name>_<variant>_profile.txt and where its
GPU sat idle (`_timeline.txt`, `benchmarks.step_timeline`); --keep-trace: its chrome trace too (`_trace.json.gz`)."""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks import step_timeline
from benchmarks.common import MODEL_CONFIGS, RESULTS, markdown_table, write_results
from benchmarks.grpo import build, grpo_config, resolve, stop_ids
from benchmarks.grpo_hook import StepProfile
from benchmarks.grpo_stats import GRPOStats
from benchmarks.grpo_workload import REWARDS, WORKLOADS, lora_config, make_dataset, make_tokenizer, stop_probability
from cb_sync import CBConfig
from cb_sync.tuning import KernelTuning, LoraTuning

VARIANTS = {"grouped": dict(group_by_length=True),
            "width1": dict(group_by_length=True, width_multiple=1),
            "ungrouped": dict(group_by_length=False),
            "no_cudnn": dict(group_by_length=True, cudnn=False),
            "no_warmup": dict(group_by_length=True, warmup=False),
            "compiled": dict(group_by_length=True, config=dict(torch_compile=True)),
            "input_casts": dict(group_by_length=True, skip_casts=False),
            "compiled_layers": dict(group_by_length=True, trainer=dict(compile_layers=True)),
            "batch_invariant": dict(group_by_length=None, trainer=dict(cb_config=CBConfig(batch_invariant=True))),
            "batch_invariant_m64": dict(group_by_length=None, trainer=dict(cb_config=CBConfig(
                batch_invariant=True, tuning=KernelTuning(lora=LoraTuning(fixed_block_m=64, fixed_block_k=64)))))}


class SyntheticRollouts:
    """Stands in for the trainer's `_generate_single_turn`: completions of random tokens whose lengths follow the
    workload's law, drawn from one seeded stream (the same completions for every variant), and -1.0 logprobs."""

    def __init__(self, work, tokenizer, stops: list[int] | None, seed: int):
        self.rng = random.Random(seed)
        self.max_len = work.max_completion
        self.stop_p = None if work.mean_completion is None else stop_probability(work.max_completion,
                                                                                   work.mean_completion)
        self.eos = tokenizer.eos_token_id
        low = len(tokenizer.all_special_ids) + 8
        self.tokens = [t for t in range(low, len(tokenizer)) if t not in set(stops or [])]
        self.lengths: list[int] = []

    def length(self) -> int:
        if self.stop_p is None:
            return self.max_len
        return min(self.max_len, 1 + int(math.log(1.0 - self.rng.random()) / math.log(1.0 - self.stop_p)))

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        completions = []
        for _ in prompt_ids:
            n = self.length()
            ids = [self.rng.choice(self.tokens) for _ in range(n)]
            if n < self.max_len:
                ids[-1] = self.eos          # stopped: ends with a stop token, as a sampled completion would
            completions.append(ids)
        self.lengths.extend(len(ids) for ids in completions)
        return completions, [[-1.0] * len(ids) for ids in completions]


class ForwardTokens:
    """Within the block, TRL's logprob forward (which the default paths of CBSyncGRPOTrainer call per chunk of rows;
    batch-invariant mode runs its own, so there only the reference forward's is seen) records the [rows, width] it
    is given."""

    def __init__(self):
        self.shapes: list[tuple[int, int]] = []

    @contextlib.contextmanager
    def watching(self):
        from trl import GRPOTrainer
        forward = GRPOTrainer._get_per_token_logps_and_entropies

        def recording(trainer, model, input_ids, *args, **kwargs):
            self.shapes.append(tuple(input_ids.shape))
            return forward(trainer, model, input_ids, *args, **kwargs)
        GRPOTrainer._get_per_token_logps_and_entropies = recording
        try:
            yield
        finally:
            GRPOTrainer._get_per_token_logps_and_entropies = forward

    def take(self) -> list[tuple[int, int]]:
        shapes, self.shapes = self.shapes, []
        return shapes


@contextlib.contextmanager
def variant_settings(width_multiple: int | None = None, cudnn: bool = True, warmup: bool = True,
                     skip_casts: bool = True):
    """length_groups.WIDTH_MULTIPLE, SDPA's cuDNN switch, the trainer's attention warm-up and its skipping of LoRA
    input casts for one variant, restored after."""
    from cb_sync.integrations.trl import attention_warmup, length_groups, lora_input_casts
    saved = (length_groups.WIDTH_MULTIPLE, torch.backends.cuda.cudnn_sdp_enabled(), attention_warmup.warm_attention,
             lora_input_casts.round_trip_layers)
    length_groups.WIDTH_MULTIPLE = width_multiple or saved[0]
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    if not warmup:
        attention_warmup.warm_attention = lambda *args, **kwargs: None
    if not skip_casts:
        lora_input_casts.round_trip_layers = lambda model: []
    try:
        yield
    finally:
        length_groups.WIDTH_MULTIPLE = saved[0]
        torch.backends.cuda.enable_cudnn_sdp(saved[1])
        attention_warmup.warm_attention = saved[2]
        lora_input_casts.round_trip_layers = saved[3]


class StepTokens(GRPOStats):
    """GRPOStats, each step's row also holding its completion lengths and the forwards' shapes."""

    def __init__(self, rollouts: SyntheticRollouts, forwards: ForwardTokens, **kwargs):
        super().__init__(**kwargs)
        self.rollouts, self.forwards = rollouts, forwards

    def on_step_end(self, args, state, control, **kwargs):
        super().on_step_end(args, state, control, **kwargs)
        shapes = self.forwards.take()
        self.rows[-1].update(completion_lens=self.rollouts.lengths, forward_tokens=sum(r * w for r, w in shapes),
                             forward_widths=sorted({w for _, w in shapes}))
        self.rollouts.lengths = []


def run_variant(name: str, args, tokenizer, dataset) -> dict:
    """Train one variant for args.steps steps on the synthetic rollouts; its summary row."""
    from transformers import PrinterCallback

    from cb_sync.integrations.trl import CBSyncGRPOTrainer
    settings = dict(VARIANTS[name])
    group_by_length, config = settings.pop("group_by_length"), settings.pop("config", {})
    trainer_options = settings.pop("trainer", {})
    stops = stop_ids(args, tokenizer)
    torch.manual_seed(args.seed)
    model = build(args, tokenizer, stops, args.model)
    rollouts, forwards = SyntheticRollouts(args.work, tokenizer, stops, args.seed), ForwardTokens()
    stats = StepTokens(rollouts, forwards, backend=name, verbose=not args.tiny, cuda=not args.tiny)
    callbacks = [stats]
    if args.profile_step:
        callbacks.append(StepProfile(args.profile_step, args.out / f"{args.name}_{name}_profile.txt", not args.tiny,
                                     timeline=True, keep_trace=args.keep_trace))
    with tempfile.TemporaryDirectory() as tmp, variant_settings(**settings), forwards.watching():
        trainer = CBSyncGRPOTrainer(model=model, reward_funcs=REWARDS,
                                    args=grpo_config(args, tmp, args.work, **config), train_dataset=dataset,
                                    processing_class=tokenizer, peft_config=lora_config(),
                                    group_by_length=group_by_length, callbacks=callbacks, **trainer_options)
        trainer.remove_callback(PrinterCallback)
        trainer._generate_single_turn = rollouts
        with step_timeline.marked_phases(trainer) if args.profile_step else contextlib.nullcontext():
            trainer.train()
    forwards_seen = not trainer.cb_config.batch_invariant
    del trainer, model
    return summarize(name, stats.rows, args.warmup, forwards_seen)


def summarize(name: str, steps: list[dict], warmup: int, forwards_seen: bool = True) -> dict:
    """A variant's row; forwards_seen False (batch-invariant mode, whose policy forwards ForwardTokens does not see):
    no forward tokens or widths."""
    timed = steps[warmup:] or steps
    completion = [sum(s["completion_lens"]) for s in timed]
    seconds = [s["step_s"] for s in timed]
    return {"variant": name, "steps": len(steps), "median_step_s": round(statistics.median(seconds), 3),
            "ms_per_1k_completion_tokens": round(1e6 * sum(seconds) / max(sum(completion), 1), 1),
            "forward_tokens_per_step": round(statistics.mean(s["forward_tokens"] for s in timed))
            if forwards_seen else None,
            "forward_widths": len({w for s in steps for w in s["forward_widths"]}) if forwards_seen else None,
            "peak_gib": None if steps[0]["peak_gib"] is None else round(max(s["peak_gib"] for s in steps), 2),
            "nonfinite_grad_steps": [s["step"] for s in steps if not math.isfinite(s.get("grad_norm") or 0.0)],
            "per_step": [{k: s.get(k) for k in ("step", "step_s", "main_cpu_s", "grad_norm", "completion_lens",
                                                 "forward_tokens", "forward_widths")} for s in steps]}


def report(args, rows: list[dict]) -> str:
    headers = ["variant", "steps", "median step s", "training ms per 1k completion tokens", "forward tokens a step",
               "distinct forward widths", "peak GiB (torch)", "steps with a non-finite grad norm"]
    table = markdown_table(headers, [[r["variant"], r["steps"], r["median_step_s"], r["ms_per_1k_completion_tokens"],
                                      _or_na(r["forward_tokens_per_step"]), _or_na(r["forward_widths"]),
                                      r["peak_gib"],
                                      ", ".join(map(str, r["nonfinite_grad_steps"])) or "none"]
                                     for r in rows])
    first = rows[0]["per_step"]
    lengths = [n for s in first for n in s["completion_lens"]]
    shape = "tiny Qwen3, CPU" if args.tiny else f"{args.model} shape"
    per_step = "\n".join(_steps_line(row) for row in rows)
    return (f"# The training half of Workload {args.workload} ({shape}), synthetic rollouts\n\n"
            f"{args.steps} steps a variant, medians without the first {args.warmup}; every variant trained on the "
            f"same completions (mean length {statistics.mean(lengths):.0f}, max {max(lengths)}).\n\n"
            f"{table.rstrip()}\n\nSeconds of each step in order (the widths of its logprob forwards):\n\n{per_step}\n")


def _or_na(value) -> str:
    return "n/a" if value is None else f"{value:,}"


def _steps_line(row: dict) -> str:
    """'- variant: 7.78 (704/768), ...': a variant's step seconds in order, each with its forwards' widths where
    they were seen."""
    seen = row["forward_widths"] is not None
    steps = (f"{s['step_s']:.2f}" + (f" ({'/'.join(map(str, s['forward_widths']))})" if seen else "")
             for s in row["per_step"])
    return f"- {row['variant']}: " + ", ".join(steps)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny Qwen3, fp32")
    parser.add_argument("--workload", default="G2", choices=list(WORKLOADS))
    parser.add_argument("--model", default="qwen3-4b", choices=list(MODEL_CONFIGS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps a variant (6; tiny 2)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the medians (2; tiny 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile-step", type=int, default=0, help="profile this step of each variant (0: none)")
    parser.add_argument("--keep-trace", action="store_true", help="keep the profiled step's chrome trace (.json.gz)")
    parser.add_argument("--name", default="grpo_training")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    steps, warmup = (2, 1) if args.tiny else (6, 2)
    args.steps = steps if args.steps is None else args.steps
    args.warmup = warmup if args.warmup is None else args.warmup
    args.max_completion = args.shots = args.cb_max_batch_tokens = None
    args.beta = 0.04
    resolve(args)
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    tokenizer = make_tokenizer(512 if args.tiny else 151936)
    dataset = make_dataset(n=args.work.dataset_size, shots=args.shots, seed=args.seed)
    rows = []
    for name in args.variants:
        rows.append(run_variant(name, args, tokenizer, dataset))
        print({k: v for k, v in rows[-1].items() if k != "per_step"}, flush=True)
        write_results(args.name, rows, report(args, rows), args.out)
    print(report(args, rows))
    return rows


if __name__ == "__main__":
    main()
