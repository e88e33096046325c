"""Shared fixtures: tiny random models of real architectures (fp32, CPU), a word-level tokenizer over their
vocabulary and the `gpu` marker."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # Triton kernels run on the CPU, before anything imports triton

import pytest
from transformers import (AutoModelForCausalLM, Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config,
                          Qwen3Config)

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               initializer_range=0.2)   # peaked logits: greedy choices are far from ties

ARCHS = {
    "llama": lambda: LlamaConfig(**_COMMON),
    "qwen2": lambda: Qwen2Config(**_COMMON),
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=16),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=24),
    "gemma2": lambda: Gemma2Config(**_COMMON, head_dim=16, sliding_window=24, attn_logit_softcapping=20.0,
                                   final_logit_softcapping=15.0),
}


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def make_model(arch: str, seed: int = 0, lora: bool = False) -> torch.nn.Module:
    """A tiny randomly initialised model of `arch` in eval mode, with no EOS so every request runs to length."""
    torch.manual_seed(seed)
    attn = "eager" if arch == "gemma2" else "sdpa"       # newer transformers refuse sdpa for soft-capping
    model = AutoModelForCausalLM.from_config(ARCHS[arch](), attn_implementation=attn).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                 "gate_proj", "up_proj", "down_proj"]))
        model.eval()
    return model


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF generate, one prompt at a time, greedy."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


class StepLog(list):
    """A driver observer (`SyncCBDriver(observer=...)`): every step's output (`runner.StepOutput`), in launch order."""

    def __call__(self, output) -> None:
        self.append(output)


def make_tokenizer(padding_side: str = "right"):
    """A word-level tokenizer over make_model's vocabulary, built offline: "<pad>" is id 0 (make_model's pad token),
    "t<i>" id i."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({"<pad>": 0, **{f"t{i}": i for i in range(1, VOCAB)}}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", padding_side=padding_side)


def random_prompts(lengths, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(params=sorted(ARCHS))
def arch(request):
    return request.param
