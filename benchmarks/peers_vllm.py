"""Workload T through vLLM, one engine per process (benchmarks.throughput --isolate starts it):
    python -m benchmarks.peers_vllm --engine vllm|vllm_nolora --batches 4 32 128 --name NAME --out DIR

`vllm` decodes with the benchmark's LoRA r32 adapter (the same PEFT adapter cb_sync runs, written with
save_pretrained, passed as a LoRARequest), `vllm_nolora` without one (what TRL's vLLM path runs: it merges the
adapter into the weights). The model is the Qwen3-4B shape from its config.json with vLLM's dummy weights (values do
not change the cost: EOS is ignored). One engine serves every batch size: its start (compile, CUDA-graph capture)
is timed once, then each batch gets a warm-up call and the median of REPEATS timed calls. vLLM reserves
gpu_memory_utilization of the card for weights, activations and its KV pool, in its own process: rows record what
is in use on the card before and after the start (`card_held_gib`, its `peak_gib`) and that reservation.
A failure is a row with its error (the import, the start, or one batch).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (RESULTS, build_model, exit_code, floor_seconds_per_step, gpu_state, qwen3_4b_config,
                               write_results)
from benchmarks.isolation import card_memory
from benchmarks.throughput import REPEATS, _table, make_prompts

ENGINES = {"vllm": True, "vllm_nolora": False}     # engine -> decodes with the LoRA adapter
GPU_MEMORY_UTILIZATION = 0.8
MAX_MODEL_LEN = 1024


def llm_kwargs(model_dir: str, lora: bool, gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
               max_model_len: int = MAX_MODEL_LEN) -> dict:
    """vLLM's LLM(...) arguments: random (dummy) weights from the config, token-id prompts, LoRA r32 slots."""
    kwargs = dict(model=model_dir, load_format="dummy", dtype="bfloat16", max_model_len=max_model_len,
                  gpu_memory_utilization=gpu_memory_utilization, skip_tokenizer_init=True)
    if lora:
        kwargs.update(enable_lora=True, max_lora_rank=32, max_loras=1)
    return kwargs


def sampling_kwargs(new_tokens: int, sampler: str = "greedy") -> dict:
    """Greedy (or "grpo": TRL's default sampling, temperature 1 without a filter), exactly new_tokens tokens (EOS
    ignored), token ids only."""
    return dict(max_tokens=new_tokens, temperature=1.0 if sampler == "grpo" else 0.0, ignore_eos=True,
                detokenize=False)


def write_engine_inputs(root: Path, lora: bool, tiny: bool = False) -> tuple[str, str | None, int]:
    """config.json of the benchmark model in root/model and, with lora, the benchmark's PEFT adapter (built as the
    other engines build it, on the GPU where there is one, then freed) in root/adapter; returns (model dir, adapter
    dir, vocab size)."""
    config = qwen3_4b_config(tiny)
    config.architectures = ["Qwen3ForCausalLM"]
    model_dir, adapter_dir = root / "model", None
    config.save_pretrained(model_dir)
    if lora:
        adapter_dir = root / "adapter"
        cuda = torch.cuda.is_available()
        model = build_model(lora=True, tiny=tiny, device="cuda" if cuda else "cpu",
                            dtype=torch.bfloat16 if cuda else torch.float32)
        model.save_pretrained(adapter_dir)
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        adapter_dir = str(adapter_dir)
    return str(model_dir), adapter_dir, config.vocab_size


def error_rows(base: dict, batches: list[int], error: str) -> list[dict]:
    return [{**base, "batch": batch, "error": error} for batch in batches]


def run(engine: str, batches: list[int], prompt_len: int, new_tokens: int, tiny: bool = False,
        gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION, on_row=lambda rows: None, sampler: str = "greedy",
        repeats: int = REPEATS, warmup_tokens: int | None = None, max_model_len: int = MAX_MODEL_LEN) -> list[dict]:
    """Rows of one vLLM engine at every batch size (each failure a row with its error): each the median of `repeats`
    timed calls after a warm-up call of warmup_tokens new tokens (None: as many as the timed calls)."""
    lora = ENGINES[engine]
    base = {"engine": engine, "model": "qwen3-tiny" if tiny else "qwen3-4b-shape", "lora": lora, "sampler": sampler,
            "prompt_len": prompt_len, "new_tokens": new_tokens, "process": "own"}
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest
    except Exception as error:
        return error_rows(base, batches, f"vllm could not be imported: {error!r}")
    base["vllm"] = vllm.__version__
    if not torch.cuda.is_available():
        return error_rows(base, batches, "vLLM needs a CUDA device; none is visible")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, adapter_dir, vocab = write_engine_inputs(Path(tmp), lora, tiny)
        before = card_memory()
        start = time.perf_counter()
        try:
            llm = LLM(**llm_kwargs(model_dir, lora, gpu_memory_utilization, max_model_len))
        except Exception as error:
            return error_rows(base, batches, f"engine start failed: {error!r}"[:2000])
        base["engine_start_s"] = round(time.perf_counter() - start, 1)
        base.update(card_fields(before, card_memory(), gpu_memory_utilization))
        params = SamplingParams(**sampling_kwargs(new_tokens, sampler))
        warmup = SamplingParams(**sampling_kwargs(warmup_tokens or new_tokens, sampler))
        request = LoRARequest("cb_sync_bench", 1, adapter_dir) if lora else None
        prompts = make_prompts(vocab, batches, prompt_len)
        for batch in batches:
            inputs = [TokensPrompt(prompt_token_ids=ids) for ids in prompts[batch]]
            try:
                rows.append({**base, "batch": batch, **_measure(llm, inputs, (warmup, params), request, repeats, tiny),
                             **gpu_state()})
            except Exception as error:
                rows += error_rows(base, [batch], f"generate failed: {error!r}"[:2000])
            print(rows[-1], flush=True)
            on_row(rows)
        _shutdown(llm)
    return rows


def card_fields(before, after, gpu_memory_utilization: float) -> dict:
    """The card's memory in use before the engine started and after, what it holds (the difference, also its
    peak_gib) and what it reserves (gpu_memory_utilization x the card)."""
    if before is None or after is None:
        return {"peak_gib": None}
    held = round(after[0] - before[0], 2)
    return {"card_before_gib": before[0], "card_used_gib": after[0], "card_held_gib": held, "peak_gib": held,
            "card_total_gib": after[1], "gpu_memory_utilization": gpu_memory_utilization,
            "card_reserved_gib": round(gpu_memory_utilization * after[1], 2)}


def _measure(llm, inputs, params, request, repeats: int, tiny: bool) -> dict:
    def call(params):
        new_tokens = params.max_tokens
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False, lora_request=request)
        seconds = time.perf_counter() - start
        lengths = {len(out.outputs[0].token_ids) for out in outputs}
        if len(outputs) != len(inputs) or lengths != {new_tokens}:
            raise RuntimeError(f"expected {len(inputs)} outputs of {new_tokens} tokens, got {len(outputs)} "
                               f"of lengths {sorted(lengths)}")
        return seconds
    first = call(params[0])
    calls = [call(params[1]) for _ in range(repeats)]
    seconds, new_tokens = statistics.median(calls), params[1].max_tokens
    batch, prompt_len = len(inputs), len(inputs[0]["prompt_token_ids"])
    floor = new_tokens * floor_seconds_per_step(batch, prompt_len + new_tokens // 2, request is not None)
    return {"tok_per_s": round(batch * new_tokens / seconds, 1), "seconds": round(seconds, 2),
            "pct_of_floor": None if tiny else round(100 * floor / seconds, 1), "first_call_s": round(first, 2),
            "call_s": [round(s, 3) for s in calls]}


def _shutdown(llm) -> None:
    """Stop the engine's core process; whatever is left ends with this process (and its process group)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as error:
        print(f"engine shutdown: {error!r}", flush=True)
    del llm
    gc.collect()


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, choices=list(ENGINES))
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 32, 128])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=GPU_MEMORY_UTILIZATION)
    parser.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    parser.add_argument("--sampler", choices=["greedy", "grpo"], default="greedy")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed calls a batch (the median is reported)")
    parser.add_argument("--warmup-tokens", type=int, default=None,
                        help="new tokens of the warm-up call (default: as many as the timed calls)")
    parser.add_argument("--tiny", action="store_true", help="the tiny Qwen3 (plumbing only)")
    parser.add_argument("--name", default=None, help="result files <out>/<name>.json|md (default throughput_ENGINE)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    name = args.name or f"throughput_{args.engine}"
    save = lambda rows: write_results(name, rows, _table(rows), args.out)   # noqa: E731
    rows = run(args.engine, args.batches, args.prompt_len, args.new_tokens, args.tiny, args.gpu_memory_utilization,
               on_row=save, sampler=args.sampler, repeats=args.repeats, warmup_tokens=args.warmup_tokens,
               max_model_len=max(args.max_model_len, args.prompt_len + args.new_tokens))
    save(rows)
    print(json.dumps(rows, indent=1) if any("error" in r for r in rows) else _table(rows), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(exit_code(main()))
