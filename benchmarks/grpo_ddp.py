"""Workload G data parallel: CBSyncGRPOTrainer on 1 GPU, then on N GPUs (DDP through `accelerate launch`).

Every rank trains a replica of benchmarks.grpo's cb_sync run with that run's per-rank load (one prompt, 4
completions of --max-completion tokens a step), so N ranks train on N prompts a step; each rank's driver generates
its own prompt's completions, gradients are averaged by DDP. The runs, one after the other:
    N = 1   python -m benchmarks.grpo_ddp --worker ...                     (no launcher, no DDP: the baseline)
    N > 1   accelerate launch --multi_gpu --num_processes N -m benchmarks.grpo_ddp --worker ...
Each rank records per step its wall time, rollout time and peak GPU memory (benchmarks.grpo_stats.GRPOStats) in
<name>_n<N>_rank<r>.json; the ranks stop together when --time-limit's share runs out.

    python -m benchmarks.grpo_ddp [--tiny] [--gpus 1 2] [--steps 10] [--warmup 3] [--max-completion 512]
                                  [--cb-compile] [--cb-release-cache auto|on|off]
                                  [--cb-group-by-length auto|on|off] [--time-limit SECONDS]
                                  [--name grpo_ddp] [--out DIR]

Writes <name>.json (one row per N) and <name>.md: median step and rollout time (per step, the slowest rank), peak
GiB per rank, completions per second (N x 4 / median step time), their scaling against N = 1 (target >= 1.85x at
N = 2), and whether the replicas' trainable weights agree after the last step (fingerprints of every rank equal).
--tiny: the CPU plumbing (a 2-layer Qwen3, fp32, gloo), not the speed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS, markdown_table, write_results
from benchmarks.grpo_workload import AUTO_ON_OFF, GEN_BATCH

TARGET_SCALING = 1.85

# -- one rank -------------------------------------------------------------------------------------------------------

def worker(args) -> None:
    """Train on this rank (launched by accelerate, or alone); write <name>_n<world>_rank<r>.json."""
    from transformers import PrinterCallback, TrainerCallback

    from benchmarks.grpo import build, grpo_config
    from benchmarks.grpo_stats import GRPOStats, fingerprint
    from benchmarks.grpo_workload import REWARDS, lora_config, make_dataset, make_tokenizer
    from cb_sync import CBConfig
    from cb_sync.integrations.trl import CBSyncGRPOTrainer

    class StopTogether(TrainerCallback):
        """Every rank stops after the step at which any rank's time share ran out (DDP needs equal step counts)."""

        def on_step_end(self, targs, state, control, **kwargs):
            if torch.distributed.is_initialized():
                flag = torch.tensor([float(control.should_training_stop)], device=targs.device)
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
                control.should_training_stop = bool(flag.item())

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not args.tiny:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))   # build this rank's replica on its own GPU
    start = time.perf_counter()
    deadline = None if args.deadline is None else start + args.deadline - time.time()
    stats = GRPOStats(f"cb_sync rank {rank}/{world}", path=args.out / f"{args.name}_n{world}_rank{rank}.json",
                      verbose=rank == 0, deadline=deadline, cuda=not args.tiny)
    stats.extra.update(rank=rank, world=world)
    tokenizer = make_tokenizer(512 if args.tiny else 151936)
    dataset = make_dataset(n=64, shots=args.shots, seed=args.seed)
    torch.manual_seed(args.seed)
    model = build(args, tokenizer)
    cb_config = CBConfig(max_batch_size=GEN_BATCH, max_batch_tokens=args.cb_max_batch_tokens, compile=args.cb_compile,
                         progress_bar=False)
    trainer = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = CBSyncGRPOTrainer(model=model, reward_funcs=REWARDS, args=grpo_config(args, tmp),
                                        train_dataset=dataset, processing_class=tokenizer, peft_config=lora_config(),
                                        callbacks=[stats, StopTogether()], cb_config=cb_config,
                                        release_after_rollout=AUTO_ON_OFF[args.cb_release_cache],
                                        group_by_length=AUTO_ON_OFF[args.cb_group_by_length])
            trainer.remove_callback(PrinterCallback)
            trainer._generate = stats.timed(trainer._generate)
            stats.extra["device"] = str(trainer.accelerator.device)
            stats.extra["cb_group_by_length"] = trainer.group_by_length
            stats.extra["build_s"] = round(time.perf_counter() - start, 2)
            trainer.train()
            stats.extra["final_fingerprint"] = fingerprint(trainer.model)
    except BaseException as error:
        stats.extra["error"] = repr(error)[:2000]
        raise
    finally:
        stats.extra["init_fingerprint"] = stats.init_fingerprint
        graphs = getattr(getattr(trainer, "_cb_driver", None), "graphs", None)
        if graphs is not None:
            stats.extra["cb_capture_s_total"] = round(graphs.capture_seconds, 2)
        stats.write()

# -- the runs -------------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_argv(args, deadline: float | None) -> list[str]:
    argv = ["-m", "benchmarks.grpo_ddp", "--worker", "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--max-completion", str(args.max_completion), "--shots", str(args.shots), "--beta", str(args.beta),
            "--seed", str(args.seed), "--cb-max-batch-tokens", str(args.cb_max_batch_tokens), "--name", args.name,
            "--out", str(args.out)]
    argv += ["--tiny"] * args.tiny + ["--cb-compile"] * args.cb_compile + ["--cb-release-cache", args.cb_release_cache]
    argv += ["--cb-group-by-length", args.cb_group_by_length]
    return argv + ([] if deadline is None else ["--deadline", repr(deadline)])


def launch(n: int, args, deadline: float | None) -> tuple[int, float]:
    """Run the N-rank training (one process, or accelerate launch); returns (exit code, wall seconds)."""
    if n == 1:
        cmd = [sys.executable, *worker_argv(args, deadline)]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(n),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), *worker_argv(args, deadline)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                     os.environ.get("PYTHONPATH")]))}
    if args.tiny:
        env.setdefault("OMP_NUM_THREADS", "1")
    print(f"== {n} rank(s): {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env)
    try:
        # a margin past the deadline for the step running when it comes and the launcher's teardown
        return proc.wait(timeout=None if deadline is None else max(deadline - time.time(), 0) + 240), \
            time.perf_counter() - start
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


def read_ranks(args, n: int) -> list[dict]:
    """The per-rank records of the N-rank run, in rank order."""
    return sorted((json.loads(p.read_text()) for p in args.out.glob(f"{args.name}_n{n}_rank*.json")),
                  key=lambda r: r.get("rank", 0))


def summarize(n: int, ranks: list[dict], warmup: int) -> dict:
    """One row for the N-rank run from its per-rank records."""
    row: dict = {"gpus": n, "ranks_reported": len(ranks)}
    errors = [r["error"] for r in ranks if r.get("error")]
    if errors:
        row["error"] = errors[0]
    steps = min((len(r["steps"]) for r in ranks), default=0)
    row["steps_done"] = steps
    if steps == 0:
        return row
    per_step = [{"step": ranks[0]["steps"][i]["step"],
                 "step_s": max(r["steps"][i]["step_s"] for r in ranks),
                 "gen_s": max(r["steps"][i]["gen_s"] for r in ranks),
                 **{k: ranks[0]["steps"][i].get(k) for k in ("loss", "reward", "kl", "grad_norm", "logp_gap_mean",
                                                            "logp_gap_max")}} for i in range(steps)]
    timed = per_step[warmup:] or per_step
    step_s = statistics.median(s["step_s"] for s in timed)
    row.update(step_ms=round(1000 * step_s, 1), gen_ms=round(1000 * statistics.median(s["gen_s"] for s in timed), 1),
               timed_steps=len(timed), median_includes_warmup=not per_step[warmup:],
               completions_per_s=round(n * GEN_BATCH / step_s, 3), per_step=per_step)
    row["per_rank"] = [{"rank": r.get("rank"), "device": r.get("device"), "build_s": r.get("build_s"),
                        "gen_ms": round(1000 * statistics.median(s["gen_s"] for s in r["steps"][warmup:steps]
                                                                 or r["steps"][:steps]), 1),
                        "peak_gib": max((s["peak_gib"] for s in r["steps"][warmup:steps] or r["steps"][:steps]
                                         if s.get("peak_gib") is not None), default=None)} for r in ranks]
    finals = [r.get("final_fingerprint") for r in ranks]
    row["replicas_equal"] = None if n == 1 or None in finals else \
        len({json.dumps(f, sort_keys=True) for f in finals}) == 1
    row["same_start"] = len({json.dumps(r.get("init_fingerprint"), sort_keys=True) for r in ranks}) == 1
    return row


def add_scaling(rows: list[dict]) -> None:
    base = next((r for r in rows if r["gpus"] == 1 and r.get("completions_per_s")), None)
    for r in rows:
        if base is not None and r.get("completions_per_s") and r is not base:
            r["scaling"] = round(r["completions_per_s"] / base["completions_per_s"], 3)
            r["scaling_per_gpu"] = round(r["scaling"] / r["gpus"], 3)


def report(args, rows: list[dict]) -> str:
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    lines = [f"# Workload G, data parallel: CBSyncGRPOTrainer on {' then '.join(str(n) for n in args.gpus)} "
             f"{'process(es), CPU' if args.tiny else 'GPU(s)'}\n",
             f"Per rank: {GEN_BATCH} completions a step (1 prompt x 4 generations), completions to "
             f"{args.max_completion} tokens (EOS silenced), LoRA r32, {args.steps} steps ({args.warmup} warm-up, left "
             f"out of the medians), cb_sync's decode step {'compiled' if args.cb_compile else 'not compiled'}; "
             f"{card}. N = 1: one process, no launcher; N > 1: `accelerate launch --multi_gpu --num_processes N` "
             "(DDP). Step and rollout time: per step, the slowest rank; completions/s: N x 4 / median step time; "
             f"scaling: against N = 1 (target >= {TARGET_SCALING}x at N = 2).\n",
             "```\n" + " ".join(["python -m benchmarks.grpo_ddp", *args.command]) + "\n```\n"]
    table = []
    for r in rows:
        peaks = ", ".join(f"{p['peak_gib']:.2f}" if p.get("peak_gib") is not None else "-"
                          for p in r.get("per_rank", []))
        scaling = r.get("scaling")
        verdict = "" if scaling is None or r["gpus"] != 2 else (" (pass)" if scaling >= TARGET_SCALING else " (miss)")
        table.append([r["gpus"], f"{r.get('steps_done', 0)}/{args.steps}", r.get("step_ms", "-"), r.get("gen_ms", "-"),
                      peaks or "-", r.get("completions_per_s", "-"), "-" if scaling is None else f"{scaling}x{verdict}",
                      {True: "yes", False: "NO", None: "-"}[r.get("replicas_equal")], r.get("error", "")[:120]])
    lines.append(markdown_table(["GPUs", "steps", "median step ms", "median rollout ms", "peak GiB per rank",
                                 "completions/s", "scaling", "replicas equal", "error"], table))
    for r in rows:
        if r.get("per_step"):
            lines.append(f"\n## {r['gpus']} rank(s) per step (slowest rank; loss, reward, KL, grad norm: rank 0)\n")
            keys = ["step", "step_s", "gen_s", "loss", "reward", "kl", "grad_norm", "logp_gap_mean", "logp_gap_max"]
            lines.append(markdown_table(keys, [[("-" if s.get(k) is None else f"{s[k]:.4g}") for k in keys]
                                               for s in r["per_step"]]))
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU plumbing run: tiny Qwen3, fp32, gloo")
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="rank counts to run, in order")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (10; tiny 2)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the medians (3; tiny 1)")
    parser.add_argument("--max-completion", type=int, default=None, help="max_completion_length (512; tiny 4)")
    parser.add_argument("--shots", type=int, default=6)
    parser.add_argument("--beta", type=float, default=0.04)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cb-compile", action="store_true", help="torch.compile cb_sync's decode step")
    parser.add_argument("--cb-max-batch-tokens", type=int, default=512)
    parser.add_argument("--cb-release-cache", choices=list(AUTO_ON_OFF), default="auto")
    parser.add_argument("--cb-group-by-length", choices=list(AUTO_ON_OFF), default="auto")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds for all runs together: each gets an equal share of what is left")
    parser.add_argument("--name", default="grpo_ddp")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)   # time.time() value
    args = parser.parse_args(argv)
    for key, full, tiny in (("steps", 10, 2), ("warmup", 3, 1), ("max_completion", 512, 4)):
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else full)
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    args.command = list(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args)
        return []
    if not args.tiny and torch.cuda.device_count() < max(args.gpus):
        raise SystemExit(f"needs {max(args.gpus)} CUDA devices, found {torch.cuda.device_count()} (or --tiny)")
    rows: list[dict] = []
    start = time.time()
    try:
        for i, n in enumerate(args.gpus):
            deadline = None if args.time_limit is None else \
                time.time() + (start + args.time_limit - time.time()) / (len(args.gpus) - i)
            for stale in args.out.glob(f"{args.name}_n{n}_rank*.json"):
                stale.unlink()
            rows.append({"gpus": n})
            code, wall = launch(n, args, deadline)
            rows[-1] = {**summarize(n, read_ranks(args, n), args.warmup), "wall_s": round(wall, 1)}
            if code != 0:
                rows[-1].setdefault("error", f"exit code {code}")
    except (KeyboardInterrupt, subprocess.TimeoutExpired) as stop:   # keep what the ranks wrote
        if rows:
            rows[-1] = {**summarize(rows[-1]["gpus"], read_ranks(args, rows[-1]["gpus"]), args.warmup),
                        "error": f"stopped: {stop!r}"[:200]}
    # written after the runs: reading the card's name opens a CUDA context here, which would hold memory on GPU 0
    add_scaling(rows)
    write_results(args.name, rows, report(args, rows), out_dir=args.out)
    for r in rows:
        print({k: v for k, v in r.items() if k != "per_step"}, flush=True)
    print(f"results: {args.out / (args.name + '.md')}", flush=True)
    return rows


if __name__ == "__main__":
    main()
