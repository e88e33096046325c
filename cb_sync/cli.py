"""`cb-sync` (or `python -m cb_sync`): `demo` runs a tiny embedded model on the CPU, checked against HF generate."""

from __future__ import annotations

import argparse
from time import perf_counter

import torch


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """A small randomly initialised Qwen3 (fp32): the embedded default model, public for examples and quick tries."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, initializer_range=0.2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    return model


def demo(num_prompts: int, max_new_tokens: int, seed: int) -> int:
    """Generate greedily for random prompts, compare every token with HF generate, report both engines' speed."""
    from cb_sync import CBConfig, SamplingParams, SyncCBDriver
    model = tiny_model(seed)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 512, (int(n),), generator=gen).tolist()
               for n in torch.randint(4, 96, (num_prompts,), generator=gen)]
    driver = SyncCBDriver(model, CBConfig(max_batch_tokens=512))

    def cb_sync(new_tokens: int) -> list[list[int]]:
        return [r.token_ids for r in driver.generate(prompts, SamplingParams(max_new_tokens=new_tokens))]

    def hf_generate(new_tokens: int) -> list[list[int]]:
        with torch.no_grad():
            return [model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                   do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
                    for ids in (torch.tensor([prompt]) for prompt in prompts)]

    cb_tokens, cb_seconds = warm_timed(cb_sync, max_new_tokens)
    hf_tokens, hf_seconds = warm_timed(hf_generate, max_new_tokens)
    mismatches = sum(ours != theirs for ours, theirs in zip(cb_tokens, hf_tokens))
    tokens = sum(map(len, cb_tokens))
    print(f"{num_prompts} prompts x {max_new_tokens} new tokens, tiny Qwen3 on {driver.device}, each engine warmed up")
    print(f"cb_sync:      {tokens / cb_seconds:8.1f} tok/s ({cb_seconds:.2f} s)")
    print(f"HF generate:  {tokens / hf_seconds:8.1f} tok/s ({hf_seconds:.2f} s, one prompt at a time)")
    print(f"greedy tokens equal to HF generate: {num_prompts - mismatches}/{num_prompts}")
    return 1 if mismatches else 0


def warm_timed(generate, max_new_tokens: int):
    """`generate(max_new_tokens)` timed after an untimed warm-up call of the same prompts and 2 new tokens.

    The first call in a process pays one-off costs (the first use of each kernel, thread pools, the allocator's first
    blocks; on a cold machine, torch's libraries read from disk) that would otherwise land in the timing of whichever
    engine runs first. Both engines get the same warm-up. Returns the timed call's result and its seconds."""
    generate(min(2, max_new_tokens))
    start = perf_counter()
    result = generate(max_new_tokens)
    return result, perf_counter() - start


def positive_int(text: str) -> int:
    """argparse type: an int > 0 (otherwise argparse's one-line error and exit code 2)."""
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    from cb_sync import __version__
    parser = argparse.ArgumentParser(prog="cb-sync", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run_demo = commands.add_parser("demo", help="tiny embedded model on the CPU, checked against HF generate")
    run_demo.add_argument("--prompts", type=positive_int, default=16, help="random prompts of 4-95 tokens (16)")
    run_demo.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens per prompt (32)")
    run_demo.add_argument("--seed", type=int, default=0, help="seed of the model's weights and the prompts (0)")
    args = parser.parse_args(argv)
    return demo(args.prompts, args.max_new_tokens, args.seed)
