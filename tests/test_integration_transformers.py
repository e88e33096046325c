"""cb_sync.integrations.transformers: model.generate_batch drop-in (tiny random models, CPU, fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig, Qwen3Config
from transformers.generation.continuous_batching import RequestStatus
from transformers.generation.continuous_batching.requests import GenerationOutput

from cb_sync import CBConfig, SamplingParams
from cb_sync.integrations.transformers import (disable, enable, get_driver, is_enabled,
                                               sampling_params_from_generation_config)

VOCAB = 128
PROMPTS = [[5, 17, 33], [9, 10, 11, 12, 13, 14, 15], [100], [5, 17, 33], [64, 3, 77, 2, 90, 41]]


def tiny_model(seed: int = 0, initializer_range: float = 0.2) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         initializer_range=initializer_range, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # runs to length unless a test sets an EOS
    return model


def lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    cfg = LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0, init_lora_weights=False,
                     target_modules=["q_proj", "v_proj", "up_proj"])
    return get_peft_model(model, cfg).eval()


def hf_greedy(model, prompt, max_new_tokens, eos_token_id=None):
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones_like(torch.tensor([prompt])),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    if eos_token_id is not None and eos_token_id in tokens:
        tokens = tokens[: tokens.index(eos_token_id) + 1]
    return tokens


def greedy_config(n: int, **extra) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, do_sample=False, **extra)


@pytest.fixture
def model():
    m = tiny_model()
    yield m
    disable(m)


def test_generate_batch_equals_hf_greedy_in_input_order(model):
    assert enable(model) is model and is_enabled(model)
    out = model.generate_batch(PROMPTS, generation_config=greedy_config(10))
    assert list(out) == [f"req_{i}" for i in range(len(PROMPTS))]
    for i, prompt in enumerate(PROMPTS):
        o = out[f"req_{i}"]
        assert isinstance(o, GenerationOutput) and o.request_id == f"req_{i}"
        assert o.prompt_ids == prompt
        assert o.generated_tokens == hf_greedy(model, prompt, 10), i
        assert o.status == RequestStatus.FINISHED and o.is_finished() and o.error is None
        assert o.logprobs == [] and o.finish_reason == "length"
    # greedy outputs are not all the same sequence (the comparison has teeth)
    assert len({tuple(o.generated_tokens) for o in out.values()}) >= 3


def test_eos_from_model_generation_config_stops_like_hf(model):
    enable(model)
    free = model.generate_batch(PROMPTS, generation_config=greedy_config(12))
    eos = free["req_1"].generated_tokens[4]  # a token greedy decoding of prompt 1 emits at step 5
    model.generation_config.eos_token_id = eos
    out = model.generate_batch(PROMPTS, generation_config=greedy_config(12))
    for i, prompt in enumerate(PROMPTS):
        expected = hf_greedy(model, prompt, 12, eos_token_id=eos)
        assert out[f"req_{i}"].generated_tokens == expected, i
    assert out["req_1"].generated_tokens[-1] == eos and len(out["req_1"].generated_tokens) <= 5
    assert out["req_1"].finish_reason == "eos"
    # an explicit empty EOS list switches EOS off again
    again = model.generate_batch(PROMPTS, generation_config=greedy_config(12, eos_token_id=[]))
    assert len(again["req_1"].generated_tokens) == 12


def test_negative_eos_ids_mean_no_eos_as_transformers_writes_them(model):
    """transformers' own generate_batch writes eos_token_id=-1 into a GenerationConfig without an EOS ("disabled"):
    reused with the drop-in, that config runs to length, and a negative id in a list is dropped, the others kept."""
    enable(model)
    free = model.generate_batch(PROMPTS, generation_config=greedy_config(12))
    out = model.generate_batch(PROMPTS, generation_config=greedy_config(12, eos_token_id=-1))
    assert [o.generated_tokens for o in out.values()] == [o.generated_tokens for o in free.values()]
    assert all(o.finish_reason == "length" for o in out.values())
    tokens = free["req_1"].generated_tokens
    eos = tokens[4]
    stopped = model.generate_batch(PROMPTS[1:2], generation_config=greedy_config(12, eos_token_id=[-1, eos]))
    assert stopped["req_0"].generated_tokens == tokens[:tokens.index(eos) + 1]
    assert stopped["req_0"].finish_reason == "eos"
    (p,) = sampling_params_from_generation_config(model, greedy_config(3, eos_token_id=[5, -1, 7]), [[3]])
    assert p.eos_token_id == [5, 7]


def test_logprobs_are_log_softmax_of_the_model(model):
    enable(model)
    out = model.generate_batch(PROMPTS[:3], generation_config=greedy_config(6),
                               continuous_batching_config=ContinuousBatchingConfig(return_logprobs=True))
    for o in out.values():
        assert len(o.logprobs) == len(o.generated_tokens) == 6
        ids = torch.tensor([o.prompt_ids + o.generated_tokens])
        with torch.no_grad():
            logits = model(ids).logits[0, len(o.prompt_ids) - 1:-1]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(o.generated_tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(o.logprobs), expected, atol=1e-4, rtol=1e-4)
    # the cb_sync kwarg asks for them too
    out = model.generate_batch([[4, 5]], generation_config=greedy_config(3), return_logprobs=True)
    assert len(out["req_0"].logprobs) == 3


def test_generation_config_mapping(model, monkeypatch):
    cfg = GenerationConfig(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, max_new_tokens=6,
                           eos_token_id=[1, 7], pad_token_id=0, output_scores=True, use_cache=True)
    (p,) = sampling_params_from_generation_config(model, cfg, [[3, 4]], logprobs=True)
    assert p == SamplingParams(max_new_tokens=6, do_sample=True, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05,
                               eos_token_id=[1, 7], logprobs=True)
    # unset fields resolve like generate(): model.generation_config first, then transformers' defaults
    monkeypatch.setattr(model.generation_config, "temperature", 0.5)
    (p,) = sampling_params_from_generation_config(model, GenerationConfig(do_sample=True), [[3, 4, 5]])
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.max_new_tokens) == (0.5, 50, 1.0, 0.0, 17)
    # greedy ignores sampling-only values (top_k=50 default, a temperature) instead of refusing them
    (p,) = sampling_params_from_generation_config(model, GenerationConfig(do_sample=False, temperature=0.3,
                                                                         top_k=50, max_new_tokens=4), [[1]])
    assert not p.do_sample and p.max_new_tokens == 4
    # keyword arguments come last, as generate()'s: a None among them unsets (a filter off, no EOS)
    monkeypatch.setattr(model.generation_config, "eos_token_id", 7)
    (p,) = sampling_params_from_generation_config(model, GenerationConfig(do_sample=True), [[3]], top_k=None,
                                                  eos_token_id=None, max_new_tokens=2)
    assert (p.top_k, p.eos_token_id, p.max_new_tokens) == (0, [], 2)


def test_a_none_keyword_unsets_as_in_generate(model, monkeypatch):
    first, second = hf_greedy(model, PROMPTS[0], 2)
    assert first != second
    monkeypatch.setattr(model.generation_config, "eos_token_id", second)     # hit at the second token
    enable(model)
    out = model.generate_batch(PROMPTS[:1], max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert out["req_0"].generated_tokens == hf_greedy(model, PROMPTS[0], 6)
    assert len(model.generate_batch(PROMPTS[:1], max_new_tokens=6, do_sample=False)["req_0"].generated_tokens) == 2
    disable(model)


def test_sampling_is_seeded_and_groups_differ():
    model = tiny_model(initializer_range=0.02)  # flat logits: samples vary
    enable(model)
    cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=8)
    prompts = [[5, 6, 7]] * 4
    first = model.generate_batch(prompts, generation_config=cfg, seed=3)
    second = model.generate_batch(prompts, generation_config=cfg,
                                  continuous_batching_config=ContinuousBatchingConfig(seed=3))
    assert [o.generated_tokens for o in first.values()] == [o.generated_tokens for o in second.values()]
    assert len({tuple(o.generated_tokens) for o in first.values()}) == 4
    for bad in (-3, 2**63, 1.5, True):
        with pytest.raises(ValueError, match="seed must be None or an int"):
            model.generate_batch(prompts, generation_config=cfg, seed=bad)
    unseeded = model.generate_batch(prompts, generation_config=cfg)
    assert len({tuple(o.generated_tokens) for o in unseeded.values()}) == 4
    disable(model)


@pytest.mark.parametrize("option", [dict(num_beams=2), dict(num_return_sequences=2), dict(no_repeat_ngram_size=2),
                                    dict(typical_p=0.5), dict(bad_words_ids=[[4]]), dict(presence_penalty=0.5),
                                    dict(begin_suppress_tokens=[3])])
def test_unsupported_generation_options_raise(model, option):
    enable(model)
    name = next(iter(option))
    with pytest.raises(ValueError, match=name):
        model.generate_batch(PROMPTS, generation_config=greedy_config(4, **option))


def test_unsupported_option_in_model_generation_config_raises(model):
    enable(model)
    model.generation_config.no_repeat_ngram_size = 2
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        model.generate_batch(PROMPTS, generation_config=greedy_config(4))
    model.generation_config.no_repeat_ngram_size = 0  # neutral value: accepted
    assert len(model.generate_batch(PROMPTS, generation_config=greedy_config(4))) == len(PROMPTS)


@pytest.mark.parametrize("options", [dict(repetition_penalty=1.3), dict(repetition_penalty=0.8),
                                     dict(min_new_tokens=6), dict(min_length=9), dict(suppress_tokens=[64, 97]),
                                     dict(repetition_penalty=1.2, min_new_tokens=4, suppress_tokens=[7])])
def test_penalties_and_minimum_lengths_give_hf_generates_tokens(model, options):
    """repetition_penalty, min_new_tokens, min_length (EOS masked until both are reached) and suppress_tokens from a
    GenerationConfig: HF generate's greedy tokens with the same config."""
    enable(model)
    eos = model.generate_batch(PROMPTS[:1], generation_config=greedy_config(3))["req_0"].generated_tokens[2]
    out = model.generate_batch(PROMPTS, generation_config=greedy_config(12, eos_token_id=eos, **options))
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            expected = model.generate(input_ids=torch.tensor([prompt]), generation_config=greedy_config(
                12, eos_token_id=eos, pad_token_id=0, **options))[0, len(prompt):].tolist()
        expected = expected[:expected.index(eos) + 1] if eos in expected else expected
        assert out[f"req_{i}"].generated_tokens == expected, i
    plain = model.generate_batch(PROMPTS, generation_config=greedy_config(12, eos_token_id=eos))
    assert [o.generated_tokens for o in out.values()] != [o.generated_tokens for o in plain.values()]


def test_a_models_default_repetition_penalty_is_honoured(model, monkeypatch):
    """A checkpoint's generation_config.json with a repetition penalty (Qwen2.5's instruct models ship 1.05) reaches
    the requests of a plain sampling config; vLLM's penalties only where asked (the trainer's generation_kwargs)."""
    monkeypatch.setattr(model.generation_config, "repetition_penalty", 1.05)
    (p,) = sampling_params_from_generation_config(model, GenerationConfig(do_sample=True, max_new_tokens=8), [[3]])
    assert p.repetition_penalty == 1.05 and p.do_sample
    cfg = GenerationConfig(max_new_tokens=8, min_new_tokens=2, min_length=6, presence_penalty=0.5,
                           frequency_penalty=0.25, min_tokens=4)
    with pytest.raises(ValueError, match="presence_penalty=0.5"):
        sampling_params_from_generation_config(model, cfg, [[3]])
    short, long = sampling_params_from_generation_config(model, cfg, [[3], [3] * 5], vllm_options=True)
    assert (short.presence_penalty, short.frequency_penalty) == (0.5, 0.25)
    assert (short.min_new_tokens, long.min_new_tokens) == (5, 4)     # min_length - len(prompt), min_tokens
    (p,) = sampling_params_from_generation_config(model, cfg, [[3]], vllm_options=True, min_new_tokens=20)
    assert p.min_new_tokens == 8                                        # past max_new_tokens: no EOS at all


def test_kwargs(model):
    enable(model)
    out = model.generate_batch(PROMPTS, generation_config=greedy_config(10), max_new_tokens=3)
    assert [len(o.generated_tokens) for o in out.values()] == [3] * len(PROMPTS)
    assert out["req_1"].generated_tokens == hf_greedy(model, PROMPTS[1], 3)
    with pytest.raises(ValueError, match="unexpected keyword"):
        model.generate_batch(PROMPTS, generation_config=greedy_config(3), beam_width=3)
    with pytest.raises(ValueError, match="timestamps"):
        model.generate_batch(PROMPTS, generation_config=greedy_config(3), record_timestamps=True)
    with pytest.raises(ValueError):  # the driver validates prompts
        model.generate_batch([[1, 2], [VOCAB + 5]], generation_config=greedy_config(3))
    for rows in ([[1, 2], 7], [[1, 2], {5: "x", 7: "y"}]):
        with pytest.raises(ValueError, match="request 1: a prompt must be a list of token ids"):
            model.generate_batch(rows, generation_config=greedy_config(3))
    with pytest.raises(ValueError, match="return_logprobs must be True or False, got 'no'"):
        model.generate_batch(PROMPTS, generation_config=greedy_config(3), return_logprobs="no")
    out = model.generate_batch(torch.tensor([PROMPTS[1][:3], PROMPTS[0][:3]]), generation_config=greedy_config(3))
    assert out["req_1"].generated_tokens == hf_greedy(model, PROMPTS[0][:3], 3)
    assert model.generate_batch([], generation_config=greedy_config(3)) == {}


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_a_padded_encoding_gives_each_row_its_unmasked_tokens(model, padding_side):
    """tiny_model's pad token is 0: the tokenizer's padded batch, whole or as ids and mask, generates as the unpadded
    prompts do (max_length counts the unpadded tokens); the ids alone are refused."""
    from transformers import BatchEncoding
    enable(model)
    ids = torch.zeros(len(PROMPTS), max(map(len, PROMPTS)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(PROMPTS):
        columns = slice(ids.shape[1] - len(prompt), None) if padding_side == "left" else slice(0, len(prompt))
        ids[row, columns], mask[row, columns] = torch.tensor(prompt), 1
    config = GenerationConfig(max_length=12, do_sample=False)
    expected = {k: (o.prompt_ids, o.generated_tokens) for k, o in model.generate_batch(PROMPTS, config).items()}
    for given, extra in [(BatchEncoding({"input_ids": ids, "attention_mask": mask}), {}),
                         ({"input_ids": ids.tolist(), "attention_mask": mask.tolist()}, {}),
                         (ids, {"attention_mask": mask})]:
        out = model.generate_batch(given, config, **extra)
        assert {k: (o.prompt_ids, o.generated_tokens) for k, o in out.items()} == expected
    with pytest.raises(ValueError, match=r"rows \[[0-9, ]+\] of the 2-D prompt start or end with the pad token id 0"):
        model.generate_batch(ids, config)


def test_one_driver_kept_and_released_unless_persistent(model):
    enable(model, CBConfig(block_size=4, max_batch_tokens=16))
    driver = get_driver(model)
    assert driver.config.block_size == 4
    model.generate_batch(PROMPTS, generation_config=greedy_config(3))
    assert get_driver(model) is driver and driver.cache.num_blocks == 0          # released after the call
    model.generate_batch(PROMPTS, generation_config=greedy_config(3), persistent_manager=True)
    assert get_driver(model) is driver and driver.cache.num_blocks > 0           # kept for the next one
    model.to(torch.float64)  # a cast after the driver was built: the same driver re-binds its cache
    out = model.generate_batch(PROMPTS, generation_config=greedy_config(5))
    assert get_driver(model) is driver and driver.cache.dtype == torch.float64 and driver.cache.num_blocks == 0
    assert [o.generated_tokens for o in out.values()] == [hf_greedy(model, p, 5) for p in PROMPTS]


def test_training_flag_and_attention_restored(model):
    enable(model)
    model.train()
    model.generate_batch(PROMPTS[:2], generation_config=greedy_config(3))
    assert model.training and all(m.training for m in model.modules())
    assert model.config._attn_implementation == "sdpa"
    model.eval()
    model.generate_batch(PROMPTS[:2], generation_config=greedy_config(3))
    assert not any(m.training for m in model.modules())


def test_disable_restores_what_was_there(model):
    cls_method = type(model).generate_batch
    enable(model)
    assert model.generate_batch.__func__ is not cls_method
    disable(model)
    assert not is_enabled(model) and "generate_batch" not in model.__dict__
    assert model.generate_batch.__func__ is cls_method
    with pytest.raises(ValueError):
        get_driver(model)
    # an instance attribute that was there before comes back
    sentinel = lambda *a, **k: "theirs"  # noqa: E731
    model.generate_batch = sentinel
    enable(model)
    assert model.generate_batch is not sentinel
    disable(model)
    assert model.generate_batch is sentinel
    del model.generate_batch


def test_peft_wrapped_model():
    peft_model = lora(tiny_model())
    enable(peft_model)
    base = peft_model.get_base_model()
    expected = [hf_greedy(peft_model, p, 8) for p in PROMPTS]
    with peft_model.disable_adapter():
        without = [hf_greedy(peft_model, p, 8) for p in PROMPTS]
    assert expected != without  # the adapter changes the outputs, so the check below sees it
    out = peft_model.generate_batch(PROMPTS, generation_config=greedy_config(8))
    assert [o.generated_tokens for o in out.values()] == expected
    out = base.generate_batch(PROMPTS, generation_config=greedy_config(8))  # what TRL may reach
    assert [o.generated_tokens for o in out.values()] == expected
    assert get_driver(base) is get_driver(peft_model)
    disable(peft_model)
    assert not is_enabled(peft_model) and not is_enabled(base) and "generate_batch" not in base.__dict__


def test_enabled_then_wrapped_by_peft():
    model = tiny_model()
    enable(model)
    peft_model = lora(model)  # as GRPOTrainer(peft_config=...) does after enable(model)
    out = peft_model.generate_batch(PROMPTS, generation_config=greedy_config(8))
    assert [o.generated_tokens for o in out.values()] == [hf_greedy(peft_model, p, 8) for p in PROMPTS]
    disable(model)


def test_enabling_the_peft_wrapper_of_an_enabled_model_replaces_the_base_models_driver():
    model = tiny_model()
    enable(model)
    model.generate_batch(PROMPTS, generation_config=greedy_config(3), persistent_manager=True)
    old = get_driver(model)
    assert old.cache.num_blocks > 0
    peft_model = enable(lora(model))
    assert old.cache.num_blocks == 0 and get_driver(model) is get_driver(peft_model) is not old
    out = model.generate_batch(PROMPTS, generation_config=greedy_config(8))
    assert [o.generated_tokens for o in out.values()] == [hf_greedy(peft_model, p, 8) for p in PROMPTS]
    disable(peft_model)
    assert not is_enabled(model) and "generate_batch" not in model.__dict__


def test_deepcopy_gets_its_own_driver(model):
    enable(model)
    model.generate_batch(PROMPTS[:1], generation_config=greedy_config(2))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.mul_(-1.0)  # the copy's modules differ from the original's
    out = twin.generate_batch(PROMPTS, generation_config=greedy_config(6))
    assert get_driver(twin) is not get_driver(model)
    assert [o.generated_tokens for o in out.values()] == [hf_greedy(twin, p, 6) for p in PROMPTS]
    assert out["req_0"].generated_tokens != hf_greedy(model, PROMPTS[0], 6)
