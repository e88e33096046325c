"""The peers that run in processes of their own: vLLM for Workloads T and L, TRL + vLLM colocate and Unsloth's GRPO
path for G and G2 (their packages: benchmarks/wheels.sh, installed by benchmarks/gpu.sh).

    python -m benchmarks.peers vllm --engine vllm|vllm_nolora --workload T|L [--batches ...] [--sampler grpo] ...
    python -m benchmarks.peers unsloth [benchmarks.grpo's arguments]     # Unsloth imported first

vLLM: `vllm` decodes with the benchmarks' PEFT adapter through a LoRARequest, `vllm_nolora` without one (what TRL's
vLLM path runs: it merges the adapter into the weights). The model is the Qwen3-4B shape from its config.json with
vLLM's dummy weights (values do not change the cost: EOS is ignored). One engine start (timed) serves every batch:
each batch gets a warm-up call and the median of `--repeats` timed calls. vLLM reserves gpu_memory_utilization of the
card in its own pool: rows record the card's memory it holds (`card_held_gib`, also `peak_gib`) and reserves.

GRPO: the run's process (benchmarks.grpo) starts each peer as `python -m benchmarks.grpo --backends B --row-file F`
(Unsloth: `python -m benchmarks.peers unsloth ...`, with its own target directory first on the path: its TRL is
older than the run's), from the random model and its tokenizer saved with save_pretrained. TRL + vLLM runs with TRL's
defaults (importance-sampling correction on); `weight_sync_check` tells whether TRL's weight sync reaches vLLM.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import (build_model, call_floor_seconds, card_memory, exit_code, free_cached_memory, gpu_state,
                                model_config, random_prompts, run_child, write_results)

VLLM_BACKENDS = ("trl_vllm", "trl_vllm_sleep")
GRPO_PEERS = (*VLLM_BACKENDS, "unsloth")
UNSLOTH_SITE = os.environ.get("UNSLOTH_SITE", "/tmp/usite")   # Unsloth's own target directory (its TRL in it)
SYNC_PARAM = "model.layers.0.self_attn.o_proj.weight"          # the weight compared between vLLM and the trainer
KILL_GRACE_S = 120                                             # past its share, a child gets this long to finish
GPU_MEMORY_UTILIZATION = 0.8


# -- vLLM for Workloads T and L -----------------------------------------------------------------------------------

def llm_kwargs(model_dir: str, lora: bool, gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
               max_model_len: int = 1024) -> dict:
    """vLLM's LLM(...) arguments: dummy weights from the config, token-id prompts, a LoRA r32 slot."""
    kwargs = dict(model=model_dir, load_format="dummy", dtype="bfloat16", max_model_len=max_model_len,
                  gpu_memory_utilization=gpu_memory_utilization, skip_tokenizer_init=True)
    return {**kwargs, **(dict(enable_lora=True, max_lora_rank=32, max_loras=1) if lora else {})}


def sampling_kwargs(new_tokens: int, sampler: str = "greedy") -> dict:
    """Greedy or "grpo" (TRL's default: temperature 1 without a filter), exactly new_tokens tokens, ids only."""
    return dict(max_tokens=new_tokens, temperature=1.0 if sampler == "grpo" else 0.0, ignore_eos=True,
                detokenize=False)


def write_engine_inputs(root: Path, lora: bool, tiny: bool = False) -> tuple[str, str | None, int]:
    """config.json of the model in root/model and, with lora, the benchmarks' PEFT adapter in root/adapter (built as
    the other engines build it, then freed); returns (model dir, adapter dir, vocab size)."""
    config = model_config(tiny=tiny)
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(root / "model")
    adapter_dir = None
    if lora:
        adapter_dir = root / "adapter"
        cuda = torch.cuda.is_available()
        build_model(lora=True, tiny=tiny, device="cuda" if cuda else "cpu",
                    dtype=torch.bfloat16 if cuda else torch.float32).save_pretrained(adapter_dir)
        free_cached_memory()
    return str(root / "model"), adapter_dir and str(adapter_dir), config.vocab_size


def card_fields(before, after, gpu_memory_utilization: float) -> dict:
    """The card's memory in use before the engine started and after, what it holds and what it reserves."""
    if before is None or after is None:
        return {"peak_gib": None}
    held = round(after[0] - before[0], 2)
    return {"card_before_gib": before[0], "card_held_gib": held, "peak_gib": held, "card_total_gib": after[1],
            "gpu_memory_utilization": gpu_memory_utilization,
            "card_reserved_gib": round(gpu_memory_utilization * after[1], 2)}


def run_vllm(args, on_row=lambda rows: None) -> list[dict]:
    """Rows of one vLLM engine at every batch size; a failure (the import, the start, a batch) is a row with it."""
    lora = args.engine == "vllm"
    base = {"engine": args.engine, "workload": args.workload, "model": "qwen3-tiny" if args.tiny else
            "qwen3-4b-shape", "lora": lora, "sampler": args.sampler, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "process": "own"}

    def failed(batches, error: str) -> list[dict]:
        return [{**base, "batch": batch, "error": error[:2000]} for batch in batches]
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
    except Exception as error:
        return failed(args.batches, f"vllm could not be imported: {error!r}")
    if not torch.cuda.is_available():
        return failed(args.batches, "vLLM needs a CUDA device; none is visible")
    base["vllm"] = vllm.__version__
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, adapter_dir, vocab = write_engine_inputs(Path(tmp), lora, args.tiny)
        before, start = card_memory(), time.perf_counter()
        try:
            llm = LLM(**llm_kwargs(model_dir, lora, args.gpu_memory_utilization,
                                   max(args.max_model_len, args.prompt_len + args.new_tokens)))
        except Exception as error:
            return failed(args.batches, f"engine start failed: {error!r}")
        base.update(engine_start_s=round(time.perf_counter() - start, 1),
                    **card_fields(before, card_memory(), args.gpu_memory_utilization))
        request = LoRARequest("cb_sync_bench", 1, adapter_dir) if lora else None
        prompts = random_prompts(vocab, args.batches, args.prompt_len)

        def call(inputs, new_tokens: int) -> float:
            start = time.perf_counter()
            outputs = llm.generate(inputs, SamplingParams(**sampling_kwargs(new_tokens, args.sampler)),
                                   use_tqdm=False, lora_request=request)
            lengths = {len(out.outputs[0].token_ids) for out in outputs}
            if len(outputs) != len(inputs) or lengths != {new_tokens}:
                raise RuntimeError(f"expected {len(inputs)} outputs of {new_tokens} tokens, got {len(outputs)} of "
                                   f"lengths {sorted(lengths)}")
            return time.perf_counter() - start
        for batch in args.batches:
            inputs = [TokensPrompt(prompt_token_ids=ids) for ids in prompts[batch]]
            try:
                first = call(inputs, args.warmup_tokens or args.new_tokens)
                calls = [call(inputs, args.new_tokens) for _ in range(args.repeats)]
                seconds = statistics.median(calls)
                floor = call_floor_seconds(batch, args.prompt_len, args.new_tokens, lora)
                rows.append({**base, "batch": batch, "tok_per_s": round(batch * args.new_tokens / seconds, 1),
                             "seconds": round(seconds, 2), "first_call_s": round(first, 2),
                             "call_s": [round(s, 3) for s in calls],
                             "pct_of_floor": None if args.tiny else round(100 * floor / seconds, 1), **gpu_state()})
            except Exception as error:
                rows += failed([batch], f"generate failed: {error!r}")
            print(rows[-1], flush=True)
            on_row(rows)
        try:
            llm.llm_engine.engine_core.shutdown()   # whatever is left ends with this process group
        except Exception as error:
            print(f"engine shutdown: {error!r}", flush=True)
    return rows


def vllm_main(argv) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers vllm")
    parser.add_argument("--engine", required=True, choices=["vllm", "vllm_nolora"])
    parser.add_argument("--workload", default="T", choices=["T", "L"])
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 32, 128])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--sampler", choices=["greedy", "grpo"], default="greedy")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls a batch (the median is reported)")
    parser.add_argument("--warmup-tokens", type=int, default=None, help="new tokens of the warm-up call")
    parser.add_argument("--gpu-memory-utilization", type=float, default=GPU_MEMORY_UTILIZATION)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--name", default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.workload == "T":
        from benchmarks.throughput import OUT, table
    else:
        from benchmarks.long_rollouts import OUT, table
    name, out = args.name or f"{args.engine}_{args.workload}", args.out or OUT
    save = lambda rows: write_results(name, rows, table(rows), out)    # noqa: E731
    rows = run_vllm(args, save)
    save(rows)
    return rows


# -- GRPO: TRL + vLLM colocate and Unsloth ------------------------------------------------------------------------

def trl_vllm_kwargs(sleep: bool, stops: list[int] | None = None) -> dict:
    """GRPOConfig arguments of the TRL + vLLM backends, TRL's defaults otherwise; a workload's stop tokens reach
    vLLM's sampling as stop_token_ids."""
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
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def skip_reason(backend: str, args) -> str | None:
    """Why a GRPO peer cannot run here (checked without importing it: Unsloth patches on import), or None."""
    if backend in VLLM_BACKENDS and importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (no module named 'vllm' on this Python path)"
    if backend == "unsloth" and not (Path(args.unsloth_site) / "unsloth" / "__init__.py").is_file():
        return f"Unsloth's own target directory {args.unsloth_site} holds no unsloth package (benchmarks/gpu.sh)"
    if backend in GRPO_PEERS and (args.tiny or not torch.cuda.is_available()):
        return f"{backend} needs a CUDA device; this run is on the CPU"
    return None


def peer_config(backend: str, args, grpo_config, output_dir: str, stops):
    """The peer's GRPOConfig: the run's (benchmarks.grpo.grpo_config, every default Unsloth changes given
    explicitly), with TRL + vLLM's own arguments. Under Unsloth, trl.GRPOConfig is Unsloth's patched class."""
    if backend == "unsloth":
        return grpo_config(args, output_dir)
    os.environ.update(distributed_env())         # before the config starts accelerate
    return grpo_config(args, output_dir, **trl_vllm_kwargs(backend == "trl_vllm_sleep", stops))


def grpo_trainer(backend: str, args, grpo_config, output_dir: str, stops, stats, **common):
    """The peer's trainer, in its own process, on the saved model `common["model"]` (a directory)."""
    from trl import GRPOTrainer
    config = peer_config(backend, args, grpo_config, output_dir, stops)
    if backend == "unsloth":
        return unsloth_trainer(args, config, callbacks=[stats], **common)
    trainer = GRPOTrainer(args=config, callbacks=[stats], **common)
    llm = trainer.vllm_generation.llm
    llm.generate = stats.sampled(llm.generate)    # the card's memory with the KV pool awake
    return trainer


def unsloth_trainer(args, config, model: str, reward_funcs, train_dataset, processing_class, callbacks, peft_config):
    """Unsloth's GRPOTrainer on the model saved at `model`, loaded in bf16 (fast_inference=False: its rollouts are
    HF `generate`), LoRA as peft_config describes it with Unsloth's gradient checkpointing."""
    try:
        from unsloth import FastLanguageModel
    except Exception as error:
        raise RuntimeError(f"unsloth could not be imported: {error!r}") from error
    from trl import GRPOTrainer
    prompt_len = max(len(ids) for ids in processing_class(list(train_dataset["prompt"]),
                                                          add_special_tokens=False)["input_ids"])
    fast, _ = FastLanguageModel.from_pretrained(
        model_name=model, max_seq_length=prompt_len + args.max_completion, dtype=torch.bfloat16, load_in_4bit=False,
        fast_inference=False, max_lora_rank=peft_config.r, fix_tokenizer=False)
    fast = FastLanguageModel.get_peft_model(
        fast, r=peft_config.r, lora_alpha=peft_config.lora_alpha, lora_dropout=peft_config.lora_dropout,
        target_modules=sorted(peft_config.target_modules), bias="none", use_gradient_checkpointing="unsloth",
        random_state=args.seed)
    return GRPOTrainer(model=fast, args=config, reward_funcs=reward_funcs, train_dataset=train_dataset,
                       processing_class=processing_class, callbacks=callbacks)


def child_command(backend: str, argv: list[str], row_file: Path) -> list[str]:
    entry = ["benchmarks.peers", "unsloth"] if backend == "unsloth" else ["benchmarks.grpo"]
    return [sys.executable, "-m", *entry, *argv, "--row-file", str(row_file)]


def child_env(backend: str, args) -> dict[str, str]:
    """Unsloth's child sees its own target directory and this repository, not the run's Python path."""
    env = dict(os.environ)
    if backend == "unsloth":
        env.update(PYTHONPATH=os.pathsep.join([str(args.unsloth_site), str(Path(__file__).resolve().parents[1])]),
                   HF_HUB_OFFLINE="1", UNSLOTH_DISABLE_STATISTICS="1",
                   UNSLOTH_COMPILE_LOCATION=env.get("UNSLOTH_COMPILE_LOCATION", "/tmp/unsloth_compiled_cache"))
    return env


def run_grpo_peer(backend: str, argv: list[str], args, row: dict) -> None:
    """One peer in a child process; what it wrote (its row, else its per-step file and the reason) into row."""
    row_file = args.out / f"{args.name}_{backend}.row.json"
    steps_file = args.out / f"{args.name}_{backend}.json"
    row_file.unlink(missing_ok=True)
    limit = float(argv[argv.index("--time-limit") + 1]) + KILL_GRACE_S if "--time-limit" in argv else None
    outcome = run_child(child_command(backend, argv, row_file), timeout=limit, env=child_env(backend, args))
    row["process"] = "own"
    if row_file.is_file():
        row.update({k: v for k, v in json.loads(row_file.read_text()).items() if k != "engine"})
    else:
        written = json.loads(steps_file.read_text()) if steps_file.is_file() else {}
        row.update({k: v for k, v in written.items() if k not in ("backend", "steps", "engine")},
                   per_step=written.get("steps", []), error=outcome.reason(limit))
    row_file.unlink(missing_ok=True)
    if outcome.card_released is False:
        row["card_not_released"] = True


def weight_sync_check(trainer, model_dir: str, name: str = SYNC_PARAM) -> dict:
    """After training: push the trainer's weights into vLLM with TRL's own sync, then compare vLLM's copy of one
    weight with the trainer's merged weight W + B A s (PEFT's delta, computed before the sync, whose merge and
    unmerge move W), with the checkpoint vLLM started from, and with vLLM's copy before the sync."""
    try:
        gen = trainer.vllm_generation
        vllm_model = gen.llm.llm_engine.model_executor.driver_worker.model_runner.model

        def vllm_weight():
            return dict(vllm_model.named_parameters())[name].detach().clone()
        before = None if getattr(gen, "_llm_weights_sleeping", False) else vllm_weight()
        layer = trainer.accelerator.unwrap_model(trainer.model).get_submodule(
            "base_model.model." + name.rsplit(".", 1)[0])
        base = layer.base_layer.weight.detach().clone()
        with torch.no_grad():
            delta = layer.get_delta_weight("default")
            expected = base.clone()
            expected += delta                   # as PEFT's merge adds it
        gen.sync_weights()
        after = vllm_weight()
        return sync_verdict(name, after, expected, checkpoint_tensor(model_dir, name).to(after.device), base, delta,
                            before)
    except Exception as error:
        return {"error": repr(error)[:1000]}


def sync_verdict(name, after, expected, start, base, delta, before=None) -> dict:
    """The sync reaches vLLM when vLLM's copy equals the trainer's merged weight and differs from the checkpoint
    where the merged weight does (None: the LoRA update is below bf16's resolution everywhere)."""
    mismatch, expected_changed = int((after != expected).sum()), int((expected != start).sum())
    changed = int((after != start).sum())
    return {"name": name, "numel": after.numel(), "mismatch_vs_trainer": mismatch, "changed_vs_start": changed,
            "expected_changed": expected_changed, "lora_delta_max": float(delta.abs().max()),
            "base_drift": int((base != start).sum()),
            "changed_by_last_sync": None if before is None else int((after != before).sum()),
            "reaches": None if expected_changed == 0 else mismatch == 0 and changed == expected_changed}


def checkpoint_tensor(model_dir: str, name: str) -> torch.Tensor:
    """One tensor of a save_pretrained directory (one file, or shards with an index)."""
    from safetensors import safe_open
    root, index = Path(model_dir), Path(model_dir) / "model.safetensors.index.json"
    file = root / (json.loads(index.read_text())["weight_map"][name] if index.is_file() else "model.safetensors")
    with safe_open(str(file), framework="pt") as handle:
        return handle.get_tensor(name)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["vllm"]:
        return sys.exit(exit_code(vllm_main(argv[1:])))
    if argv[:1] == ["unsloth"]:
        try:
            import unsloth  # noqa: F401  (before transformers, peft and TRL: it patches them on import)
        except Exception as error:       # the backend's row then carries the error
            print(f"unsloth could not be imported: {error!r}", flush=True)
        from benchmarks import grpo
        return grpo.main(argv[1:])
    raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
