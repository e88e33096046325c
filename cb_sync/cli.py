"""Command line: `cb-sync demo` generates with a tiny embedded model on the CPU and checks it against HF."""

from __future__ import annotations

import argparse
import time

import torch


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """A small randomly initialised Qwen3 (fp32): the embedded default model."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, initializer_range=0.2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    return model


def demo(num_prompts: int, max_new_tokens: int, seed: int) -> int:
    """Generate greedily for random prompts, compare every token with HF generate, report throughput."""
    from cb_sync import CBConfig, SamplingParams, SyncCBDriver
    model = tiny_model(seed)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 512, (int(n),), generator=gen).tolist()
               for n in torch.randint(4, 96, (num_prompts,), generator=gen)]
    driver = SyncCBDriver(model, CBConfig(max_batch_tokens=512))
    start = time.perf_counter()
    results = driver.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    cb_seconds = time.perf_counter() - start
    start = time.perf_counter()
    mismatches = 0
    with torch.no_grad():
        for prompt, result in zip(prompts, results):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
            mismatches += out[0, len(prompt):].tolist() != result.token_ids
    hf_seconds = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    print(f"{num_prompts} prompts x {max_new_tokens} new tokens, tiny Qwen3 on {driver.device}")
    print(f"cb_sync:      {tokens / cb_seconds:8.1f} tok/s ({cb_seconds:.2f} s)")
    print(f"HF generate:  {tokens / hf_seconds:8.1f} tok/s ({hf_seconds:.2f} s, one prompt at a time)")
    print(f"greedy tokens equal to HF generate: {num_prompts - mismatches}/{num_prompts}")
    return 1 if mismatches else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cb-sync", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run_demo = commands.add_parser("demo", help="tiny embedded model on the CPU, checked against HF generate")
    run_demo.add_argument("--prompts", type=int, default=16)
    run_demo.add_argument("--max-new-tokens", type=int, default=32)
    run_demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return demo(args.prompts, args.max_new_tokens, args.seed)


if __name__ == "__main__":
    raise SystemExit(main())
