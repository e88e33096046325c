"""Greedy output equals HF generate token for token (fp32, CPU) under batching, chunking and preemption."""

from __future__ import annotations

import pytest

from cb_sync import CBConfig, SamplingParams, SyncCBDriver

from conftest import hf_greedy, make_model, random_prompts

LENGTHS = [1, 3, 16, 17, 45, 120, 300, 7]


def _check_equal(model, prompts, params, results):
    assert [r.request_id for r in results] == list(range(len(prompts)))
    for prompt, p, result in zip(prompts, params, results):
        assert result.prompt_ids == prompt
        assert result.token_ids == hf_greedy(model, prompt, p.max_new_tokens)
        assert result.finish_reason == "length"


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_mixed_lengths_match_hf(arch, batch_invariant):
    model = make_model(arch)
    prompts = random_prompts(LENGTHS)
    params = [SamplingParams(max_new_tokens=n) for n in (5, 12, 3, 20, 9, 14, 6, 1)]
    config = CBConfig(block_size=16, max_batch_tokens=512, batch_invariant=batch_invariant)
    results = SyncCBDriver(model, config).generate(prompts, params)
    _check_equal(model, prompts, params, results)


@pytest.mark.parametrize("arch_name", ["qwen3", pytest.param("mistral", marks=pytest.mark.slow)])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_preemption_and_chunked_prefill_match_hf(arch_name, batch_invariant):
    model = make_model(arch_name)
    prompts = random_prompts([40, 9, 70, 25, 2, 33])
    params = [SamplingParams(max_new_tokens=24)] * len(prompts)
    driver = SyncCBDriver(model, CBConfig(block_size=8, num_blocks=16, max_batch_tokens=24, max_batch_size=4,
                                          batch_invariant=batch_invariant))
    results = driver.generate(prompts, params)
    _check_equal(model, prompts, params, results)


@pytest.mark.slow
def test_preemption_really_happens():
    model = make_model("llama")
    prompts = random_prompts([30, 30, 30, 30])
    seen = []
    driver = SyncCBDriver(model, CBConfig(block_size=4, num_blocks=24, max_batch_tokens=64),
                          observer=lambda step: seen.append([c.request.num_preemptions for c in step.plan]))
    params = SamplingParams(max_new_tokens=40)
    results = driver.generate(prompts, params)
    assert any(n > 0 for step in seen for n in step)
    _check_equal(model, prompts, [params] * 4, results)


@pytest.mark.parametrize("arch_name", ["llama", "qwen3", "gemma2"])
def test_lora_model_matches_hf(arch_name):
    model = make_model(arch_name, lora=True)
    prompts = random_prompts([5, 31, 64])
    params = [SamplingParams(max_new_tokens=10)] * 3
    results = SyncCBDriver(model, CBConfig(block_size=16, max_batch_tokens=32)).generate(prompts, params)
    _check_equal(model, prompts, params, results)


def test_eos_stops_and_is_included():
    model = make_model("qwen3")
    prompt = random_prompts([12])[0]
    free_run = hf_greedy(model, prompt, 20)
    eos = free_run[6]
    first = free_run.index(eos)
    result = SyncCBDriver(model).generate([prompt], SamplingParams(max_new_tokens=20, eos_token_id=eos))[0]
    assert result.token_ids == free_run[:first + 1]
    assert result.finish_reason == "eos"
    stop = SyncCBDriver(model).generate([prompt], SamplingParams(max_new_tokens=20, stop_token_ids=[eos]))[0]
    assert stop.token_ids == free_run[:first + 1] and stop.finish_reason == "stop"


def test_model_generation_config_eos_is_the_default():
    model = make_model("llama")
    prompt = random_prompts([10])[0]
    free_run = hf_greedy(model, prompt, 15)
    model.generation_config.eos_token_id = [free_run[4], 127]
    result = SyncCBDriver(model).generate([prompt], SamplingParams(max_new_tokens=15))[0]
    assert result.token_ids == free_run[:free_run.index(free_run[4]) + 1]
    assert result.finish_reason == "eos"
