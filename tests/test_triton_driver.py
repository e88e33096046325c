"""The driver on the Triton backend (interpreted on the CPU) matches HF greedy, incl. sliding window + softcap."""

from __future__ import annotations

import pytest

from cb_sync import CBConfig, SamplingParams, SyncCBDriver

from conftest import hf_greedy, make_model, random_prompts

pytest.importorskip("triton")


@pytest.mark.parametrize("arch", ["qwen3", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_triton_backend_matches_hf_greedy(arch):
    model = make_model(arch)
    prompts = random_prompts([5, 30, 17])
    driver = SyncCBDriver(model, CBConfig(attn_backend="triton", block_size=8, max_batch_tokens=16))
    results = driver.generate(prompts, SamplingParams(max_new_tokens=6))
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 6) for p in prompts]


@pytest.mark.slow
def test_triton_backend_with_lora_kernels_matches_hf_greedy():
    """PEFT LoRA layers run the Triton LoRA kernel in decode steps; tokens stay HF's."""
    model = make_model("llama", lora=True)
    prompts = random_prompts([7, 21])
    driver = SyncCBDriver(model, CBConfig(attn_backend="triton", block_size=8, max_batch_tokens=16))
    results = driver.generate(prompts, SamplingParams(max_new_tokens=5))
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 5) for p in prompts]
    assert not any("forward" in m.__dict__ for m in model.modules())
