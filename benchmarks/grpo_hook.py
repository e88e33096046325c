"""Where a CBSyncGRPOTrainer rollout's time goes: Workload G's (or G2's) rollouts through the trainer against the same
driver called alone on the same requests, with each step's executor path, the garbage collector's pauses and (--profile)
a torch.profiler table of one call each way; --profile-step K: torch.profiler tables of optimizer step K as a whole
(rollout and training: `grpo_hook_step.txt`, by CUDA time and by CPU time).

    python -m benchmarks.grpo_hook [--tiny] [--workload G2] [--model qwen3-1.7b] [--steps 5] [--cb-compile] [--profile]
        [--cb-group-by-length auto|on|off] [--profile-step K] [--out DIR]

Rows: every trainer rollout (`_generate` wall time, the driver's own call inside it, steps by path, GC seconds), then
the driver alone on the last rollout's prompts, as the trainer leaves the model (accelerate's autocast forward in
place) and with the model's own forward (the instance forward set aside for the call).
"""

from __future__ import annotations

import argparse
import collections
import gc
import gzip
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from benchmarks import step_timeline
from benchmarks.common import MODEL_CONFIGS, build_model, gpu_state
from benchmarks.grpo import build, grpo_config, resolve, stop_ids
from benchmarks.grpo_workload import AUTO_ON_OFF, REWARDS, WORKLOADS, lora_config, make_dataset, make_tokenizer
from benchmarks.throughput import _gc_pauses


class PathCounter:
    """An observer of the driver: steps by (path, kind), and replays redone after a tie (known once read, so counted
    when taken)."""

    def __init__(self):
        self.outputs = []

    def __call__(self, output):
        self.outputs.append(output)

    def take(self) -> dict:
        outputs, self.outputs = self.outputs, []
        counts = collections.Counter(f"{output.path}/{output.kind.name}" for output in outputs)
        counts["redone"] = sum(getattr(output, "redone", False) for output in outputs)
        return {key: n for key, n in counts.items() if n}


class StepProfile(TrainerCallback):
    """torch.profiler over optimizer step `step` (1-based), from its begin to its end; tables into `path`. With
    `timeline`, also `step_timeline`'s report of where the GPU sat idle (`<path stem>_timeline.txt`, printed too) and,
    with `keep_trace`, the chrome trace it read (`<path stem>_trace.json.gz`, a few MB)."""

    def __init__(self, step: int, path: Path, cuda: bool, timeline: bool = False, keep_trace: bool = False):
        self.step, self.path, self.cuda, self.prof = step, path, cuda, None
        self.timeline, self.keep_trace = timeline, keep_trace

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.prof is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        averages = self.prof.key_averages()
        self.path.write_text("\n\n".join(f"sorted by {key}\n" + averages.table(sort_by=key, row_limit=60)
                                         for key in (("self_cuda_time_total",) if self.cuda else ())
                                         + ("self_cpu_time_total", "cpu_time_total")))
        if self.timeline:
            trace = self.path.with_name(self.path.stem + "_trace.json")
            try:
                self.prof.export_chrome_trace(str(trace))
                text = step_timeline.report(step_timeline.summarize(step_timeline.load(trace)))
                if self.keep_trace:
                    with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
                        shutil.copyfileobj(raw, packed)
            finally:
                trace.unlink(missing_ok=True)
            self.path.with_name(self.path.stem + "_timeline.txt").write_text(text)
            print(text, flush=True)
        self.prof = None


class StepClock(TrainerCallback):
    """Each optimizer step's wall time, and every garbage collection of over 10 ms with its generation and step."""

    def __init__(self, cuda: bool):
        self.card = CardSampler() if cuda else None
        self.per_step = []
        self.cuda, self.steps, self.optimizer_s, self.collections, self._started = cuda, [], [], [], []
        self._t0 = self._optimizer_t0 = 0.0
        gc.callbacks.append(self._collection)

    def _collection(self, phase, info):
        if phase == "start":
            self._started.append(time.perf_counter())
        elif self._started:
            seconds = time.perf_counter() - self._started.pop()
            if seconds > 0.01:
                self.collections.append({"step": len(self.steps) + 1, "generation": info["generation"],
                                         "s": round(seconds, 3), "collected": info["collected"]})

    def on_step_begin(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        if self.card is not None:
            self.card.take()
        self._t0 = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        self._optimizer_t0 = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        self.optimizer_s.append(round(time.perf_counter() - self._optimizer_t0, 3))

    def on_step_end(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        self.steps.append(round(time.perf_counter() - self._t0, 3))
        if self.card is not None:
            self.per_step.append(self.card.take())


def timed(fn, cuda: bool):
    if cuda:
        torch.cuda.synchronize()
    with _gc_pauses() as pauses:
        start = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return out, seconds, pauses[0]


class CardSampler:
    """A thread sampling the card's SM clock (MHz), power (W) and temperature (C) every `period` seconds; `take()`
    gives (min clock, max power, max temperature) since the last take. Also each step's process and main-thread CPU
    seconds (another thread of this process busy shows as process CPU above the main thread's)."""

    def __init__(self, period: float = 0.25):
        import threading
        self.samples, self.period = [], period
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.cpu = (sum(os.times()[:2]), time.thread_time())
        self.thread.start()

    def _run(self):
        while True:
            time.sleep(self.period)
            state = gpu_state()
            if "sm_mhz" not in state:
                return
            self.samples.append((state["sm_mhz"], state["gpu_w"], state["gpu_c"]))

    def take(self) -> dict:
        samples, self.samples = self.samples, []
        cpu, self.cpu = self.cpu, (sum(os.times()[:2]), time.thread_time())
        out = {"process_cpu_s": round(self.cpu[0] - cpu[0], 2), "main_thread_cpu_s": round(self.cpu[1] - cpu[1], 2)}
        if samples:
            out.update(min_sm_mhz=min(s[0] for s in samples), max_power_w=round(max(s[1] for s in samples)),
                       max_temp_c=max(s[2] for s in samples))
        return out


class Phases:
    """Synchronised wall seconds of wrapped trainer methods, per optimizer step (`StepClock` numbers the steps)."""

    def __init__(self, clock: StepClock, cuda: bool):
        self.clock, self.cuda, self.rows = clock, cuda, collections.defaultdict(collections.Counter)

    def wrap(self, obj, name: str):
        inner = getattr(obj, name)

        def wrapper(*args, **kwargs):
            out, seconds, _ = timed(lambda: inner(*args, **kwargs), self.cuda)
            self.rows[len(self.clock.steps) + 1][name] += round(seconds, 3)
            return out
        setattr(obj, name, wrapper)


def dynamo_frames() -> int:
    from torch._dynamo.utils import counters
    return sum(counters["frames"].values())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--workload", default="G", choices=list(WORKLOADS))
    parser.add_argument("--model", default="qwen3-4b", choices=list(MODEL_CONFIGS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--alone", type=int, default=3, help="driver-alone calls per variant")
    parser.add_argument("--variants", nargs="*", default=["as_left", "fresh_model"],
                        choices=["as_left", "own_forward", "fresh_model"])
    parser.add_argument("--max-completion", type=int, default=None)
    parser.add_argument("--cb-compile", action="store_true")
    parser.add_argument("--cb-group-by-length", choices=list(AUTO_ON_OFF), default="auto",
                        help="CBSyncGRPOTrainer(group_by_length=None / True / False)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-step", type=int, default=0, help="profile this optimizer step (0: none)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    args.beta, args.seed, args.warmup, args.shots, args.cb_max_batch_tokens = 0.04, 0, None, None, None
    resolve(args)       # the workload's settings where none is given
    work = args.work
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = not args.tiny
    from cb_sync import CBConfig, SyncCBDriver
    from cb_sync.integrations.trl import CBSyncGRPOTrainer

    tokenizer = make_tokenizer(512 if args.tiny else 151936)
    dataset = make_dataset(n=work.dataset_size, shots=args.shots, seed=0)
    torch.manual_seed(0)
    model = build(args, tokenizer, stop_ids(args, tokenizer), args.model)
    rows, counter, last, clock = [], PathCounter(), {}, StepClock(cuda)
    phases = Phases(clock, cuda)
    cb_config = CBConfig(max_batch_size=work.rollout, max_batch_tokens=args.cb_max_batch_tokens,
                         compile=args.cb_compile, progress_bar=False)

    def measured(what: str, driver, fn, **extra):
        """Run fn (one rollout) and add its row: seconds, GC, steps by path, capture/warm-up seconds, compiles."""
        replay = driver.runner.replay
        before = (replay.graphs.capture_seconds, replay.warmup_seconds) if replay is not None else (0.0, 0.0)
        frames = dynamo_frames()
        out, seconds, gc_s = timed(fn, cuda)
        after = (replay.graphs.capture_seconds, replay.warmup_seconds) if replay is not None else (0.0, 0.0)
        rows.append({"what": what, "s": round(seconds, 3), "gc_s": round(gc_s, 3), "paths": counter.take(),
                     "capture_s": round(after[0] - before[0], 3), "warmup_s": round(after[1] - before[1], 3),
                     "dynamo_frames": dynamo_frames() - frames, **extra})
        print(rows[-1], flush=True)
        return out

    profiled = [StepProfile(args.profile_step, args.out / "grpo_hook_step.txt", cuda)] if args.profile_step else []
    with tempfile.TemporaryDirectory() as tmp:
        trainer = CBSyncGRPOTrainer(model=model, reward_funcs=REWARDS, train_dataset=dataset,
                                    processing_class=tokenizer, peft_config=lora_config(),
                                    args=grpo_config(args, tmp, work), cb_config=cb_config,
                                    group_by_length=AUTO_ON_OFF[args.cb_group_by_length], callbacks=[clock] + profiled)
        driver = trainer.cb_driver
        driver.runner.observer = counter
        unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        inner_generate, outer_generate = trainer._generate_single_turn, trainer._generate

        def single_turn(prompt_ids, *rest, **kwargs):
            last["prompts"] = [list(p) for p in prompt_ids]
            out, last["inner_s"], _ = timed(lambda: inner_generate(prompt_ids, *rest, **kwargs), cuda)
            return out

        def generate(prompts):
            out = measured("trainer rollout", driver, lambda: outer_generate(prompts), step=len(clock.steps) + 1)
            rows[-1]["driver_s"] = round(last["inner_s"], 3)      # the driver's call inside TRL's _generate
            return out
        trainer._generate_single_turn, trainer._generate = single_turn, generate
        for name in ("_calculate_rewards", "_get_per_token_logps_and_entropies", "compute_loss"):
            phases.wrap(trainer, name)
        phases.wrap(trainer.accelerator, "backward")
        with _gc_pauses() as train_gc:
            start = time.perf_counter()
            trainer.train()
        print(f"train: {time.perf_counter() - start:.1f} s, GC {train_gc[0]:.2f} s", flush=True)

        params = trainer._cb_params
        lora = next(p for n, p in unwrapped.named_parameters() if "lora_A" in n)
        facts = {"instance_forward": "forward" in unwrapped.__dict__, "lora_dtype": str(lora.dtype),
                 "training": unwrapped.training, "gradient_checkpointing": trainer.args.gradient_checkpointing,
                 "mixed_precision": trainer.accelerator.mixed_precision, "gc_objects": len(gc.get_objects()),
                 "step_s": clock.steps, "optimizer_s": clock.optimizer_s, "card": clock.per_step,
                 "phases": {k: dict(v) for k, v in phases.rows.items()}, "collections": clock.collections}
        print(facts, flush=True)

        def alone(label: str, on):
            for _ in range(args.alone):
                on.release()
                measured(label, on, lambda: on.generate(last["prompts"], params, progress_bar=False))
            if args.profile and cuda:
                on.release()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
                    on.generate(last["prompts"], params, progress_bar=False)
                    torch.cuda.synchronize()
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
                (args.out / f"grpo_hook_{label.split()[-1]}.txt").write_text(table)
                counter.take()

        if "as_left" in args.variants:
            alone("driver alone, as_left", driver)
        if "own_forward" in args.variants:
            own = unwrapped.__dict__.pop("forward", None)
            try:
                alone("driver alone, own_forward", driver)
            finally:
                if own is not None:
                    unwrapped.forward = own
        if "fresh_model" in args.variants:      # the throughput benchmarks' model: bf16 base, fp32 adapters
            fresh = SyncCBDriver(build_model(lora=True, tiny=args.tiny, device="cpu" if args.tiny else "cuda",
                                             dtype=torch.float32 if args.tiny else torch.bfloat16, shape=args.model),
                                 cb_config, observer=counter)
            alone("driver alone, fresh_model", fresh)
    gc.callbacks.remove(clock._collection)
    result = {"facts": facts, "rows": rows}
    (args.out / "grpo_hook.json").write_text(json.dumps(result, indent=1))
    print("\n| what | step | s | GC s | capture s | warm-up s | dynamo frames | paths |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['what']} | {r.get('step', '')} | {r['s']:.3f} | {r['gc_s']:.3f} | {r['capture_s']:.3f} | "
              f"{r['warmup_s']:.3f} | {r['dynamo_frames']} | {r['paths']} |")
    print("steps:", clock.steps, "optimizer:", clock.optimizer_s)
    for step, row in phases.rows.items():
        print(step, dict(row), clock.per_step[step - 1] if len(clock.per_step) >= step else "")
    return result


if __name__ == "__main__":
    main()
