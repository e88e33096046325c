"""Workload G's peers that run in a process of their own: TRL + vLLM colocate (`trl_vllm`, `trl_vllm_sleep`) and
Unsloth's GRPO path (`unsloth`, with its own TRL <= 1.15 from its own target directory).

The run's process starts each as `python -m benchmarks.grpo --backends B --row-file F ...` (Unsloth:
`benchmarks.grpo_unsloth`, Unsloth imported first), gives it what is left of its time share, ends its process group
afterwards and waits until the card's memory is back; the child writes its row (per-step stats, summary, errors) to F,
which the run merges and gates with the others. A row the child did not write carries the reason (its exit code and
last output, or the time limit); per-step stats it wrote before that are kept.

Both peers build their models from a directory: the benchmark's random model (EOS row zeroed) and the offline
tokenizer saved with save_pretrained. `weight_sync_check` tells whether TRL's weight sync reaches vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
from pathlib import Path

import torch

from benchmarks.isolation import run_child

VLLM_BACKENDS = ("trl_vllm", "trl_vllm_sleep")
OWN_PROCESS = (*VLLM_BACKENDS, "unsloth")
UNSLOTH_SITE = os.environ.get("UNSLOTH_SITE", "/tmp/usite")   # Unsloth's own target directory (TRL 1.15 in it)
SYNC_PARAM = "model.layers.0.self_attn.o_proj.weight"          # the weight compared between vLLM and the trainer
KILL_GRACE_S = 120                                             # past its share, a child gets this long to finish


def trl_vllm_kwargs(sleep: bool, stops: list[int] | None = None) -> dict:
    """GRPOConfig arguments of the TRL + vLLM backends (TRL's defaults otherwise); `stops` (the stop tokens of a
    workload with EOS live) also reach vLLM's SamplingParams as stop_token_ids."""
    extra = {} if stops is None else {"generation_kwargs": {"stop_token_ids": stops}}
    return dict(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=sleep,
                model_init_kwargs={"dtype": torch.bfloat16}, **extra)


def distributed_env() -> dict[str, str]:
    """The single-process distributed variables vLLM's external launcher reads, with a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def save_model(model, tokenizer, path: Path) -> str:
    """The benchmark model and its tokenizer, saved with save_pretrained; returns the directory."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def skip_reason(backend: str, args) -> str | None:
    """Why a peer of this module cannot run here (checked without importing it), or None."""
    if backend in VLLM_BACKENDS:
        if importlib.util.find_spec("vllm") is None:
            return "vllm is not installed (no module named 'vllm' on this Python path)"
        if args.tiny or not torch.cuda.is_available():
            return "vLLM needs a CUDA device; this run is on the CPU"
    elif backend == "unsloth":
        site = Path(args.unsloth_site)
        if not (site / "unsloth" / "__init__.py").is_file():
            return (f"Unsloth's own target directory {site} holds no unsloth package (install Unsloth's wheels "
                    "there: stage grpo_cb of benchmarks/peers_gpu.sh)")
        if args.tiny or not torch.cuda.is_available():
            return "Unsloth's GRPO path needs a CUDA device; this run is on the CPU"
    return None


def child_command(backend: str, args, row_file: Path, time_limit: float | None) -> list[str]:
    module = "benchmarks.grpo_unsloth" if backend == "unsloth" else "benchmarks.grpo"
    shots = [args.shots] if isinstance(args.shots, int) else args.shots
    command = [sys.executable, "-m", module, "--backends", backend, "--row-file", str(row_file),
               "--workload", args.workload, "--model", args.model,
               "--name", args.name, "--out", str(args.out), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--max-completion", str(args.max_completion), "--shots", *map(str, shots), "--beta", str(args.beta),
               "--seed", str(args.seed), "--kl-atol", str(args.kl_atol), "--kl-rtol", str(args.kl_rtol),
               "--unsloth-site", str(args.unsloth_site), "--sdpa-cudnn", args.sdpa_cudnn]
    if time_limit is not None:
        command += ["--time-limit", f"{max(time_limit, 1.0):.0f}"]
    return command + (["--tiny"] if args.tiny else [])


def child_env(backend: str, args) -> dict[str, str]:
    """Unsloth's child sees its own target directory and this repository, not the run's Python path (whose TRL is
    newer than Unsloth accepts)."""
    env = dict(os.environ)
    if backend == "unsloth":
        repo = str(Path(__file__).resolve().parents[1])
        env.update(PYTHONPATH=os.pathsep.join([str(args.unsloth_site), repo]), HF_HUB_OFFLINE="1",
                   UNSLOTH_DISABLE_STATISTICS="1",
                   UNSLOTH_COMPILE_LOCATION=env.get("UNSLOTH_COMPILE_LOCATION", "/tmp/unsloth_compiled_cache"))
    return env


def run_own_process(backend: str, args, row: dict, deadline: float | None, now: float) -> None:
    """Run one backend in a child process and merge what it wrote into row."""
    row_file = args.out / f"{args.name}_{backend}.row.json"
    row_file.unlink(missing_ok=True)
    share = None if deadline is None else deadline - now
    outcome = run_child(child_command(backend, args, row_file, share), env=child_env(backend, args),
                        timeout=None if share is None else share + KILL_GRACE_S)
    row["process"] = "own"
    if row_file.is_file():
        row.update({k: v for k, v in json.loads(row_file.read_text()).items() if k != "engine"})
        row_file.unlink()
    else:
        steps_file = args.out / f"{args.name}_{backend}.json"
        if steps_file.is_file():
            written = json.loads(steps_file.read_text())
            row["per_step"] = written.get("steps", [])
            for key in ("build_s", "init_fingerprint", "stopped_early", "weight_sync"):
                if key in written:
                    row[key] = written[key]
        row["error"] = outcome.reason(None if share is None else share + KILL_GRACE_S)
    if outcome.card_released is False:
        row["card_not_released"] = True


def weight_sync_check(trainer, model_dir: str, name: str = SYNC_PARAM) -> dict:
    """After training: push the trainer's weights into vLLM with TRL's own sync, then compare vLLM's copy of one
    weight with the trainer's merged weight W + B A s, computed here with PEFT's delta as its merge adds it (before
    the sync, whose merge and unmerge move W), with the checkpoint vLLM started from, and with vLLM's copy before the
    sync (none in sleep mode: level 2 discards the weights)."""
    try:
        gen = trainer.vllm_generation
        vllm_model = gen.llm.llm_engine.model_executor.driver_worker.model_runner.model

        def vllm_weight():
            return dict(vllm_model.named_parameters())[name].detach().clone()
        before = None if getattr(gen, "_llm_weights_sleeping", False) else vllm_weight()
        peft_model = trainer.accelerator.unwrap_model(trainer.model)
        layer = peft_model.get_submodule("base_model.model." + name.rsplit(".", 1)[0])
        base = layer.base_layer.weight.detach().clone()
        with torch.no_grad():
            delta = layer.get_delta_weight("default")
            expected = base.clone()
            expected += delta                   # as PEFT's merge does
        gen.sync_weights()
        after = vllm_weight()
        start = checkpoint_tensor(model_dir, name).to(after.device)
        return sync_verdict(name, after, expected, start, base, delta, before)
    except Exception as error:
        return {"error": repr(error)[:1000]}


def sync_verdict(name, after, expected, start, base, delta, before=None) -> dict:
    """Counts behind weight_sync_check's verdict: the sync reaches vLLM when vLLM's copy equals the trainer's merged
    weight and differs from the checkpoint where the merged weight does (None: the LoRA update is below bf16's
    resolution everywhere, so nothing can tell)."""
    mismatch = int((after != expected).sum())
    expected_changed = int((expected != start).sum())
    changed = int((after != start).sum())
    return {"name": name, "numel": after.numel(), "mismatch_vs_trainer": mismatch,
            "max_abs_vs_trainer": float((after.float() - expected.float()).abs().max()),
            "changed_vs_start": changed, "expected_changed": expected_changed,
            "lora_delta_max": float(delta.abs().max()), "base_drift": int((base != start).sum()),
            "changed_by_last_sync": None if before is None else int((after != before).sum()),
            "reaches": None if expected_changed == 0 else mismatch == 0 and changed == expected_changed}


def checkpoint_tensor(model_dir: str, name: str) -> torch.Tensor:
    """One tensor of a save_pretrained directory (one file or shards with an index)."""
    from safetensors import safe_open
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    file = root / (json.loads(index.read_text())["weight_map"][name] if index.is_file() else "model.safetensors")
    with safe_open(str(file), framework="pt") as handle:
        return handle.get_tensor(name)
