"""Driver API: bad input, state restored after every call, weight updates seen, cache release."""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel

from cb_sync import CBConfig, SamplingParams, SyncCBDriver
from cb_sync.attention import ATTN_IMPLEMENTATION
from cb_sync.model_patching.generation_mode import generation_mode
from cb_sync.model_patching.swaps import module_list
from cb_sync.tuning import AttentionTuning, LoraTuning

from conftest import VOCAB, StepLog, hf_greedy, make_model, random_prompts


@pytest.fixture(scope="module")
def model():
    return make_model("qwen3")


def test_seed_is_the_third_argument_and_the_progress_bar_a_keyword_checked():
    """As the README gives it: generate(prompts, params=None, seed=None); progress_bar comes by keyword only."""
    model = make_model("qwen3")
    driver = SyncCBDriver(model, observer=StepLog())
    prompts, params = random_prompts([4, 6]), SamplingParams(max_new_tokens=6, do_sample=True, temperature=2.0)
    by_keyword = [r.token_ids for r in driver.generate(prompts, params, seed=42)]
    assert [r.token_ids for r in driver.generate(prompts, params, 42)] == by_keyword
    assert [r.token_ids for r in driver.generate(prompts, params, 43)] != by_keyword
    with pytest.raises(TypeError):
        driver.generate(prompts, params, 42, True)
    steps = StepLog()
    for bad in (42, "yes", 1):
        with pytest.raises(ValueError, match=f"progress_bar must be True, False or None, got {bad!r}"):
            SyncCBDriver(model, observer=steps).generate(prompts, params, progress_bar=bad)
    assert steps == []


def test_empty_call_returns_empty(model):
    assert SyncCBDriver(model).generate([]) == []


@pytest.mark.parametrize("prompts,match", [
    ([[1, 2], []], "request 1: empty prompt"),
    ([[1, VOCAB]], f"request 0: token {VOCAB} at position 1"),
    ([[-1]], "request 0: token -1"),
    ([[1, 2.5]], "request 0: token 2.5"),
    (["hello"], "request 0: a prompt must be a list of token ids"),
])
def test_bad_prompts_raise_before_any_work(model, prompts, match):
    steps = StepLog()
    with pytest.raises(ValueError, match=match):
        SyncCBDriver(model, observer=steps).generate(prompts, SamplingParams(max_new_tokens=2))
    assert steps == []


def test_request_that_cannot_fit_the_cache_raises(model):
    """A request feeds prompt + max_new_tokens - 1 positions: 15 + 7 need 6 blocks of 4, 15 + 6 fill 5 exactly."""
    driver = SyncCBDriver(model, CBConfig(block_size=4, num_blocks=5))
    with pytest.raises(ValueError, match=r"request 1: prompt of 15 tokens plus max_new_tokens=7 needs 6 KV blocks"):
        driver.generate(random_prompts([3, 15]), SamplingParams(max_new_tokens=7))
    prompt = random_prompts([15])[0]
    result = driver.generate([prompt], SamplingParams(max_new_tokens=6))[0]
    assert result.finish_reason == "length" and result.token_ids == hf_greedy(model, prompt, 6)


def test_params_list_must_match_prompts(model):
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        SyncCBDriver(model).generate(random_prompts([3, 4]), [SamplingParams()])


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": 0, "do_sample": True}, "temperature"), ({"top_k": 2**63}, "top_k"),
    ({"stop_token_ids": {7: "x"}}, "stop_token_ids"), ({"eos_token_id": torch.tensor(1.0)}, "eos_token_id"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"min_p": 1.0}, "min_p"), ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"seed": -3}, "seed"), ({"eos_token_id": [1, -2]}, "eos_token_id"), ({"stop_token_ids": ["a"]}, "stop"),
    ({"stop_token_ids": None}, "stop_token_ids"), ({"stop_token_ids": 3}, "stop_token_ids"), ({"top_k": True}, "top_k"),
    ({"eos_token_id": True}, "eos_token_id"), ({"temperature": 1e-50}, "temperature must be a number >= 1e-06"),
    ({"temperature": True}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"), ({"do_sample": "no"}, "do_sample must be True or False, got 'no'"),
    ({"logprobs": 1}, "logprobs"), ({"seed": True}, "seed")])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"block_size": 0}, "block_size"), ({"num_blocks": -1}, "num_blocks"), ({"attn_backend": "x"}, "attn_backend"),
    ({"max_batch_tokens": 1.5}, "max_batch_tokens"), ({"max_cache_gib": 0}, "max_cache_gib"),
    ({"max_cache_gib": float("inf")}, "max_cache_gib must be a finite number > 0, got inf"),
    ({"max_cache_gib": "16"}, "max_cache_gib"), ({"cuda_graphs": "yes"}, "cuda_graphs must be True or False"),
    ({"progress_bar": 0}, "progress_bar")])
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CBConfig(**kwargs)


def test_torch_integers_are_taken_as_plain_ints_and_greedy_takes_temperature_zero():
    params = SamplingParams(max_new_tokens=torch.tensor(3), seed=torch.tensor(7), eos_token_id=torch.tensor(5),
                            stop_token_ids=torch.tensor([6, 8]), temperature=0.0)
    assert (params.max_new_tokens, params.seed, params.eos_token_id, params.stop_token_ids) == (3, 7, 5, [6, 8])
    assert all(type(v) is int for v in (params.max_new_tokens, params.seed, params.eos_token_id))


def test_config_is_frozen_after_validation():
    config = CBConfig(max_batch_size=np.int64(8))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 8
    assert dataclasses.replace(config, max_cache_gib=2.0).max_cache_gib == 2.0


def test_cache_is_sized_to_the_requests_that_can_run_at_once(model):
    """Fifty requests, two at a time: the cache holds the two longest, not all fifty."""
    driver = SyncCBDriver(model, CBConfig(block_size=4, max_batch_size=2))
    lengths = [3] * 48 + [9, 13]
    results = driver.generate(random_prompts(lengths), SamplingParams(max_new_tokens=4))
    assert driver.cache.num_blocks == (9 + 3) // 4 + (13 + 3) // 4
    assert [len(r.token_ids) for r in results] == [4] * 50


def test_numpy_numbers_are_taken_as_plain_ones():
    params = SamplingParams(max_new_tokens=np.int64(3), temperature=np.float32(0.5), top_k=np.int32(4),
                            seed=np.uint32(7), do_sample=True)
    assert (params.max_new_tokens, params.top_k, params.seed) == (3, 4, 7)
    assert all(type(v) is int for v in (params.max_new_tokens, params.top_k, params.seed))
    assert CBConfig(max_batch_size=np.int64(8), max_cache_gib=np.float64(2.0)).max_batch_size == 8


@pytest.mark.parametrize("kwargs,match", [
    ({"partition_size": 0}, "partition_size must be a positive int, got 0"),
    ({"max_partitions": 2.0}, "max_partitions must be a positive int"),
    ({"partition_size": 48}, "partition_size must be a power of two >= 16, got 48"),
    ({"decode_block_n": 8}, "decode_block_n must be a power of two"), ({"prefill_block_m": 24}, "prefill_block_m")])
def test_bad_attention_tuning(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionTuning(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"block_m": 24}, "LoraTuning.block_m must be a power of two >= 16, got 24"),
    ({"expand_block_n": 48}, "expand_block_n"), ({"fixed_tiling": 2}, "fixed_tiling must be 0 or 1"),
    ({"mid_split_k": 200}, "mid_split_k must be a multiple of shrink_block_k"), ({"mid_rows": -1}, "mid_rows"),
    ({"shrink_warps": 0}, "shrink_warps must be a positive int"), ({"block_m": True}, "block_m")])
def test_bad_lora_tuning(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoraTuning(**kwargs)


def test_a_call_that_preempts_says_what_it_needed_on_the_log(caplog):
    model = make_model("qwen3")
    prompts, params = random_prompts([30] * 4), SamplingParams(max_new_tokens=40)
    with caplog.at_level(logging.WARNING, logger="cb_sync.engine.driver"):
        capped = SyncCBDriver(model, CBConfig(block_size=4, num_blocks=24, max_batch_tokens=64))
        results = capped.generate(prompts, params)
        assert len(caplog.records) == 1
        message = caplog.records[0].getMessage()
        per_block = capped.cache.bytes_per_block / 2**30
        assert re.match(r"[1-9]\d* preemptions: ", message), message
        assert f"the call's 4 requests need up to {72 * per_block:.3g} GiB" in message
        assert f"held {24 * per_block:.3g} GiB (CBConfig num_blocks=24)" in message
        caplog.clear()
        roomy = SyncCBDriver(model, CBConfig(block_size=4, max_batch_tokens=64)).generate(prompts, params)
        assert not caplog.records
    assert [r.token_ids for r in results] == [r.token_ids for r in roomy]


def test_state_restored_after_call_and_after_error():
    model = make_model("llama", lora=True)
    model.train()
    model.base_model.model.model.layers[0].eval()          # a mixed pattern of flags must survive
    flags = [m.training for m in model.modules()]
    impl = model.get_base_model().config._attn_implementation
    failing = []

    def observer(step):
        if failing:
            raise RuntimeError("boom")
    driver = SyncCBDriver(model, observer=observer)
    driver.generate(random_prompts([5]), SamplingParams(max_new_tokens=3))
    assert [m.training for m in model.modules()] == flags
    assert model.get_base_model().config._attn_implementation == impl
    failing.append(True)
    with pytest.raises(RuntimeError, match="boom"):
        driver.generate(random_prompts([5]), SamplingParams(max_new_tokens=3))
    assert [m.training for m in model.modules()] == flags
    assert model.get_base_model().config._attn_implementation == impl
    failing.clear()
    assert len(driver.generate(random_prompts([5]), SamplingParams(max_new_tokens=3))[0].token_ids) == 3


def test_composite_models_keep_each_sub_configs_attention():
    """A vision-language model whose towers use different attention implementations gets each back: after the
    support check, after a call, after a call that raised, and after the trainer's batch-invariant blocks."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    from cb_sync.batch_invariant.trainer import default_forward, invariant_training
    text = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=299, boi_token_index=297, eoi_token_index=298)
    model = Gemma3ForConditionalGeneration._from_config(
        config, attn_implementation={"": "sdpa", "text_config": "sdpa", "vision_config": "eager"})

    def implementations():
        c = model.config
        return c._attn_implementation, c.text_config._attn_implementation, c.vision_config._attn_implementation

    before = implementations()
    assert before == ("sdpa", "sdpa", "eager")
    failing = []

    def observer(step):
        if failing:
            raise RuntimeError("boom")
    driver = SyncCBDriver(model, CBConfig(block_size=4), observer=observer)
    assert implementations() == before
    assert len(driver.generate([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=3))[0].token_ids) == 3
    assert implementations() == before
    failing.append(True)
    with pytest.raises(RuntimeError, match="boom"):
        driver.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))
    assert implementations() == before
    with invariant_training(model):
        assert implementations() != before
        with default_forward(model):
            assert implementations() == before
        assert implementations() != before
    assert implementations() == before


def test_generation_mode_restores_what_its_body_changes():
    """Flags, the attention implementation and the rotary module's forward come back as they were on entry, also
    where the body changed them (a callback calling train(), another attention implementation) and raised."""
    model = make_model("llama", lora=True)
    model.base_model.model.model.layers[0].train()
    flags = [m.training for m in model.modules()]
    base = model.get_base_model()
    for entry_impl in ("sdpa", ATTN_IMPLEMENTATION):
        base.set_attn_implementation(entry_impl)
        with pytest.raises(RuntimeError, match="boom"), generation_mode(model):
            assert not any(m.training for m in model.modules())
            model.train()
            base.set_attn_implementation("eager")
            assert "forward" in base.model.rotary_emb.__dict__
            raise RuntimeError("boom")
        assert [m.training for m in model.modules()] == flags
        assert base.config._attn_implementation == entry_impl
        assert "forward" not in base.model.rotary_emb.__dict__


def test_module_list_walks_every_module_once_parents_first():
    model = make_model("llama", lora=True)
    shared = torch.nn.Linear(2, 2)
    model.get_base_model().model.layers[0].extra = shared
    model.get_base_model().model.layers[1].extra = shared       # one module under two parents: listed once
    modules = module_list(model)
    assert len(modules) == len({id(m) for m in modules}) == len(list(model.modules()))
    assert {id(m) for m in modules} == {id(m) for m in model.modules()}
    index = {id(m): i for i, m in enumerate(modules)}
    assert all(index[id(parent)] < index[id(child)] for parent in modules for child in parent.children())


def _attention_settings(model):
    """Every config's attention implementation, in module order."""
    return [m.config._attn_implementation for m in model.modules() if isinstance(m, PreTrainedModel)]


@pytest.mark.parametrize("composite", [False, True])
def test_generation_mode_switches_attention_as_set_attn_implementation_does(composite):
    """The switch that skips transformers' module walk for text-only models sets what `set_attn_implementation` sets;
    a model with sub-configs (a vision-language model) takes transformers' own switch."""
    if composite:
        from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
        text = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1)
        vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=8, patch_size=4)
        model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text)).eval()
        model.set_attn_implementation("sdpa")
    else:
        model = make_model("qwen3")
    before = _attention_settings(model)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    expected = _attention_settings(model)
    model.set_attn_implementation("sdpa")
    assert _attention_settings(model) == before
    with generation_mode(model):
        assert _attention_settings(model) == expected
    assert _attention_settings(model) == before


def test_in_place_weight_updates_are_seen():
    model = make_model("qwen3", lora=True)
    driver = SyncCBDriver(model)
    prompt = random_prompts([10])[0]
    before = driver.generate([prompt], SamplingParams(max_new_tokens=8))[0].token_ids
    lora_params = [p for n, p in model.named_parameters() if "lora_" in n]
    model.train()
    optimizer = torch.optim.SGD(lora_params, lr=5.0)
    loss = model(torch.tensor([prompt]), labels=torch.tensor([prompt])).loss
    loss.backward()
    optimizer.step()
    model.eval()
    after = driver.generate([prompt], SamplingParams(max_new_tokens=8))[0].token_ids
    assert after == hf_greedy(model, prompt, 8)
    assert after != before


def test_release_then_generate_again(model):
    driver = SyncCBDriver(model)
    prompts = random_prompts([7, 12])
    first = driver.generate(prompts, SamplingParams(max_new_tokens=5))
    assert driver.cache.num_blocks > 0
    driver.release()
    assert driver.cache.num_blocks == 0 and driver.cache.k_caches == []
    second = driver.generate(prompts, SamplingParams(max_new_tokens=5))
    assert [r.token_ids for r in first] == [r.token_ids for r in second]


def test_cache_is_sized_to_the_call(model):
    driver = SyncCBDriver(model, CBConfig(block_size=16))
    driver.generate(random_prompts([10, 40]), SamplingParams(max_new_tokens=8))
    assert driver.cache.num_blocks == 2 + 3        # ceil(18 / 16) + ceil(48 / 16)


def test_driver_follows_dtype_change_and_generation_config():
    model = make_model("llama")
    driver = SyncCBDriver(model)
    prompt = random_prompts([9])[0]
    driver.generate([prompt], SamplingParams(max_new_tokens=4))
    model.to(torch.float64)
    result = driver.generate([prompt], SamplingParams(max_new_tokens=4))[0]
    assert driver.cache.dtype == torch.float64 and driver.cache.k_caches[0].dtype == torch.float64
    assert result.token_ids == hf_greedy(model, prompt, 4)
    free_run = result.token_ids
    model.generation_config.eos_token_id = free_run[1]
    stopped = driver.generate([prompt], SamplingParams(max_new_tokens=4))[0]
    assert stopped.token_ids == free_run[:free_run.index(free_run[1]) + 1] and stopped.finish_reason == "eos"
    unstopped = driver.generate([prompt], SamplingParams(max_new_tokens=4, eos_token_id=[]))[0]
    assert unstopped.token_ids == free_run


def test_seeded_requests_leave_the_global_rng_alone(model):
    state = torch.get_rng_state()
    SyncCBDriver(model).generate(random_prompts([4]), SamplingParams(max_new_tokens=2, seed=3))
    assert torch.equal(state, torch.get_rng_state())


def test_learned_positions_model_matches_hf_and_refuses_too_long_requests():
    from transformers import AutoModelForCausalLM, GPT2Config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(n_positions=32, n_layer=2, n_embd=64, n_head=4,
                                                        vocab_size=VOCAB, initializer_range=0.2)).eval()
    model.generation_config.eos_token_id = None
    driver = SyncCBDriver(model)
    with pytest.raises(ValueError, match="request 1: prompt of 20 tokens plus max_new_tokens=20 exceeds the "
                                         "model's 32 learned positions"):
        driver.generate(random_prompts([3, 20]), SamplingParams(max_new_tokens=20))
    prompts = random_prompts([3, 12])
    results = driver.generate(prompts, SamplingParams(max_new_tokens=20))
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 20) for p in prompts]


def test_models_without_attention_interface_are_refused():
    from transformers import AutoModelForCausalLM, XGLMConfig
    model = AutoModelForCausalLM.from_config(XGLMConfig(num_layers=1, d_model=32, attention_heads=4, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="XGLMForCausalLM does not route attention through"):
        SyncCBDriver(model)
    assert model.config._attn_implementation != "cb_sync_paged"


def falcon():
    from transformers import AutoModelForCausalLM, FalconConfig
    return AutoModelForCausalLM.from_config(FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                                         num_attention_heads=4))


def t5():
    from transformers import T5Config, T5ForConditionalGeneration
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=1, num_heads=2,
                                               d_kv=16))


def mamba():
    from transformers import AutoModelForCausalLM, MambaConfig
    return AutoModelForCausalLM.from_config(MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1))


def hybrid():
    """Qwen3's layers, one marked as a state-keeping kind (as Qwen3-Next's linear attention)."""
    model = make_model("qwen3")
    model.config.layer_types = ["full_attention", "linear_attention"]
    return model


@pytest.mark.parametrize("build,match", [
    (falcon, "FalconForCausalLM's forward does not pass cb_sync's batch metadata (cb_meta) on to its attention "
             "layers"),
    (t5, "T5ForConditionalGeneration is an encoder-decoder model: cb_sync generates from decoder-only causal LMs"),
    (mamba, "MambaForCausalLM has no attention layers cb_sync can page: its config names no num_attention_heads"),
    (hybrid, "Qwen3ForCausalLM has layers of type ['linear_attention'], whose state cb_sync's paged KV cache does "
             "not hold"),
    (lambda: torch.nn.Linear(4, 4), "the model must be a transformers PreTrainedModel (or a PEFT model of one), got "
                                    "Linear")], ids=["falcon", "t5", "mamba", "hybrid", "linear"])
def test_models_cb_sync_cannot_drive_are_refused_at_construction(build, match):
    model = build().train()
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    with pytest.raises(ValueError, match=re.escape(match)):
        SyncCBDriver(model)
    assert all(m.training for m in model.modules())
    assert getattr(getattr(model, "config", None), "_attn_implementation", None) == attention


def test_attention_sinks_are_refused():
    from cb_sync.attention import paged_attention_forward
    q = torch.zeros(1, 2, 1, 4)
    with pytest.raises(NotImplementedError, match="attention sinks"):
        paged_attention_forward(torch.nn.Linear(1, 1), q, q, q, None, cb_meta=object(), s_aux=torch.zeros(2))


@pytest.mark.parametrize("kwargs", [{"eos_token_id": 3}, {"stop_token_ids": [1, 2]}])
def test_numpy_token_ids_are_accepted(kwargs):
    import numpy as np
    converted = {k: np.int64(v) if isinstance(v, int) else [np.int32(t) for t in v] for k, v in kwargs.items()}
    params = SamplingParams(**converted)
    for key, value in kwargs.items():
        assert getattr(params, key) == value and type(getattr(params, key)) is type(value)


def test_a_gpu_with_less_free_memory_than_the_cap_preempts_instead_of_running_out(model, monkeypatch, caplog):
    """Where the device's free memory (`device_room`) is below max_cache_gib, the cache takes what is free and the
    call preempts, its tokens those of a roomy call; a request that cannot fit that memory raises, naming it; the
    pools already held serve a call whatever is free; where the memory exceeds the cap, the cap rules."""
    import cb_sync.engine.driver as driver_module
    prompts, params = random_prompts([30] * 4), SamplingParams(max_new_tokens=40)
    roomy = SyncCBDriver(model, CBConfig(block_size=4, max_batch_tokens=64)).generate(prompts, params)
    driver = SyncCBDriver(model, CBConfig(block_size=4, max_batch_tokens=64))
    per_block, rooms, room = driver.cache.bytes_per_block, [], {"blocks": 24}
    monkeypatch.setattr(driver_module, "device_room",
                        lambda device, held, headroom: rooms.append(held) or room["blocks"] * per_block + 5)
    with caplog.at_level(logging.WARNING, logger="cb_sync.engine.driver"):
        results = driver.generate(prompts, params)
    assert driver.cache.num_blocks == 24 and rooms == [0]
    message = caplog.records[0].getMessage()
    assert re.match(r"[1-9]\d* preemptions: ", message) and "(the GPU's free memory, " in message, message
    assert "after 2 GiB kept for a step, below CBConfig max_cache_gib=16)" in message, message
    assert [r.token_ids for r in results] == [r.token_ids for r in roomy]
    with pytest.raises(ValueError, match=r"needs 25 KV blocks of 4 tokens, but the cache holds at most 24 \(the GPU's"):
        driver.generate(random_prompts([60]), params)
    room["blocks"] = 10                                   # less free than the pools hold: they still serve the call
    prompt = random_prompts([56])[0]                      # 56 + 40 - 1 positions: 24 blocks of 4
    assert driver.generate([prompt], params)[0].token_ids == hf_greedy(model, prompt, 40)
    room["blocks"] = 10 ** 9                              # more free than the cap: the cap's blocks, and its name
    capped_by_config = SyncCBDriver(model, CBConfig(block_size=4, max_cache_gib=0.0001))
    monkeypatch.setattr(driver_module, "device_room", lambda device, held, headroom: room["blocks"] * per_block)
    with pytest.raises(ValueError, match=r"but the cache holds at most \d+ \(CBConfig max_cache_gib=0.0001\)"):
        capped_by_config.generate(random_prompts([int(0.0001 * 2**30 / per_block) * 4 + 1]), params)
    assert rooms == [0, 24 * per_block, 24 * per_block]


def test_device_room_counts_free_unused_and_held_memory_less_the_headroom(monkeypatch):
    from cb_sync.cache.sizing import device_room
    assert device_room(torch.device("cpu"), 10 ** 9, 2**30) is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 5 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 4 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {"inactive_split_bytes.all.current": 2**29})
    assert device_room(torch.device("cuda", 0), 2**30, 2**31) == 5 * 2**30 - 2**29 - 2**31
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (0, 80 * 2**30))
    assert device_room(torch.device("cuda", 0), 0, 2**31) == 0


def test_step_headroom_is_at_least_the_floor_and_grows_with_the_step_and_the_model():
    """The Qwen3-4B shape at 16,384 tokens a step (~1.3 GiB measured beside weights and KV) stays at the 2 GiB floor;
    a Qwen3-32B shape there needs more, in proportion to the step's tokens above the floor."""
    from types import SimpleNamespace
    from cb_sync.cache.sizing import step_headroom
    from cb_sync.cache.sizing import MIN_STEP_HEADROOM_BYTES
    shape = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936)
    small = SimpleNamespace(hidden_size=2560, intermediate_size=9728, **shape)
    large = SimpleNamespace(hidden_size=5120, intermediate_size=25600, **{**shape, "num_attention_heads": 64})
    assert step_headroom(small, 16384, 64, 2) == MIN_STEP_HEADROOM_BYTES == 2 * 2**30
    wide, wider = step_headroom(large, 16384, 64, 2), step_headroom(large, 32768, 64, 2)
    assert 3.5 * 2**30 < wide < 4 * 2**30 and 1.9 < wider / wide < 2.0
    assert step_headroom(large, 16384, 64, 4) > wide                    # float32 activations need more room


def test_the_room_kept_for_a_step_is_the_models_estimate_and_named(model, monkeypatch):
    """The driver keeps step_headroom(model's config, max_batch_tokens, max_batch_size, dtype size) free beside the
    cache (a step of a million tokens: above the 2 GiB floor), and names it where the free memory sets the limit."""
    import cb_sync.engine.driver as driver_module
    from cb_sync.cache.sizing import step_headroom
    driver = SyncCBDriver(model, CBConfig(max_batch_tokens=10**6, max_batch_size=8))
    kept = []
    monkeypatch.setattr(driver_module, "device_room", lambda device, held, headroom: kept.append(headroom) or 2**20)
    blocks, limit = driver._capacity_blocks(model.config)
    expected = step_headroom(model.config, 10**6, 8, 4)
    assert kept == [expected] and expected > 2 * 2**30
    assert f"after {expected / 2**30:.3g} GiB kept for a step" in limit, limit


def _model_state(model):
    return model.config._attn_implementation, [m.training for m in model.modules()]


def _in_threads(*calls):
    """Run the calls at once, one thread each; their results in order (a call's exception is raised here)."""
    results, errors = [None] * len(calls), []

    def run(index, call):
        try:
            results[index] = call()
        except BaseException as error:     # noqa: BLE001 - raised again on the test's thread
            errors.append(error)
    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def _slow_steps(step):
    time.sleep(0.002)       # let another thread run between this call's steps


def test_one_driver_called_from_two_threads_gives_the_tokens_of_calls_one_after_the_other():
    model = make_model("qwen3").train()          # train mode: every module's flag must come back
    before = _model_state(model)
    driver = SyncCBDriver(model, CBConfig(block_size=4), observer=_slow_steps)
    calls = [(random_prompts([5, 9, 3], seed=2), SamplingParams(max_new_tokens=12)),
             (random_prompts([7, 2], seed=3), SamplingParams(max_new_tokens=9)),
             (random_prompts([11], seed=4), SamplingParams(max_new_tokens=15, do_sample=True, seed=5))]
    expected = [[r.token_ids for r in driver.generate(*call)] for call in calls]
    for _ in range(3):
        results = _in_threads(*(lambda call=call: driver.generate(*call) for call in calls))
        assert [[r.token_ids for r in call] for call in results] == expected
        assert _model_state(model) == before


@pytest.mark.parametrize("second_model", ["the_same_model", "another_model"])
def test_two_drivers_in_two_threads_stay_correct(second_model):
    """The second call starts while the first runs and would end after it: each gives its tokens, and the models end
    as they began (not with the settings the first call had put on the model when the second began)."""
    model = make_model("qwen3").train()
    other = model if second_model == "the_same_model" else make_model("llama").train()
    before = _model_state(model), _model_state(other)
    first_running = threading.Event()

    def first_observer(step):
        first_running.set()
        _slow_steps(step)
    first = SyncCBDriver(model, CBConfig(block_size=4), observer=first_observer)
    second = SyncCBDriver(other, CBConfig(block_size=4), observer=_slow_steps)
    short = (random_prompts([6, 4], seed=6), SamplingParams(max_new_tokens=6))
    long = (random_prompts([9], seed=7), SamplingParams(max_new_tokens=20))
    expected = [[r.token_ids for r in first.generate(*short)], [r.token_ids for r in second.generate(*long)]]

    def second_call():
        first_running.wait()
        return second.generate(*long)
    for _ in range(3):
        first_running.clear()
        results = _in_threads(lambda: first.generate(*short), second_call)
        assert [[r.token_ids for r in call] for call in results] == expected
        assert (_model_state(model), _model_state(other)) == before


def test_release_from_another_thread_waits_for_the_running_generate():
    model = make_model("qwen3")
    prompts, params = random_prompts([5, 8], seed=8), SamplingParams(max_new_tokens=10)
    expected = [r.token_ids for r in SyncCBDriver(model).generate(prompts, params)]
    first_step, released, released_during_call = threading.Event(), threading.Event(), []

    def observer(step):
        released_during_call.append(released.is_set())
        if not first_step.is_set():
            first_step.set()
            time.sleep(0.3)         # a release that did not wait would run now
    driver = SyncCBDriver(model, CBConfig(block_size=4), observer=observer)

    def release():
        first_step.wait()
        driver.release()
        released.set()
    releaser = threading.Thread(target=release)
    releaser.start()
    results = driver.generate(prompts, params)
    releaser.join()
    assert [r.token_ids for r in results] == expected
    assert not any(released_during_call) and released.is_set() and driver.cache.num_blocks == 0


def test_a_driver_built_on_another_thread_waits_for_the_running_call():
    """Construction checks the model by switching its attention and back: during another thread's call it would
    leave that call's setting behind, so it waits for the call to end (here: 0.5 s into the call, not built yet)."""
    model = make_model("qwen3").train()
    before = _model_state(model)
    built, built_during_call = threading.Event(), []
    builder = threading.Thread(target=lambda: (SyncCBDriver(model), built.set()))

    def observer(step):
        if not builder.is_alive() and not built.is_set():
            builder.start()
            built_during_call.append(built.wait(timeout=0.5))
    driver = SyncCBDriver(model, observer=observer)
    prompt = random_prompts([6])[0]
    result = driver.generate([prompt], SamplingParams(max_new_tokens=4))[0]
    builder.join()
    assert built_during_call == [False] and built.is_set()
    assert result.token_ids == hf_greedy(model, prompt, 4) and _model_state(model) == before


@pytest.mark.parametrize("nested", ["generate", "release", "generate_on_another_driver",
                                    "generate_on_another_model", "__init__"])
def test_a_call_from_the_observer_of_a_running_call_raises(nested):
    model = make_model("qwen3").train()
    before = _model_state(model)
    other, other_model = SyncCBDriver(model), SyncCBDriver(make_model("llama"))
    nested_calls = {"generate": lambda: driver.generate([[1, 2]]), "release": lambda: driver.release(),
                    "generate_on_another_driver": lambda: other.generate([[1, 2]]),
                    "generate_on_another_model": lambda: other_model.generate([[1, 2]]),
                    "__init__": lambda: SyncCBDriver(model)}
    driver = SyncCBDriver(model, observer=lambda step: nested_calls[nested]())
    with pytest.raises(RuntimeError, match=rf"SyncCBDriver.{nested.split('_on_')[0]}\(\) was called while another "
                                           r"driver call runs on this thread"):
        driver.generate([[3, 4, 5]], SamplingParams(max_new_tokens=3))
    assert _model_state(model) == before
    driver.observer = driver.runner.observer = None
    prompt = random_prompts([6])[0]
    assert driver.generate([prompt], SamplingParams(max_new_tokens=4))[0].token_ids == hf_greedy(model, prompt, 4)


def _meta_model():
    from transformers import AutoModelForCausalLM
    config = make_model("qwen3").config
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_a_model_on_the_meta_device_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"the model's parameter 'lm_head.weight' holds no values "
                                         r"\(device meta, Parameter\): load or materialise its weights"):
        SyncCBDriver(_meta_model())
    model = make_model("qwen3")
    model.model.layers[1].mlp.up_proj.to("meta")
    with pytest.raises(ValueError, match=r"parameter 'model.layers.1.mlp.up_proj.weight' holds no values \(device "
                                         "meta"):
        SyncCBDriver(model)


def test_a_weight_moved_to_the_meta_device_is_refused_before_any_work():
    model = make_model("qwen3", lora=True)
    driver = SyncCBDriver(model, observer=lambda step: pytest.fail("a step ran"))
    model.get_base_model().model.norm.to("meta")
    with pytest.raises(ValueError, match=r"parameter 'base_model.model.model.norm.weight' holds no values \(device "
                                         "meta"):
        driver.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
