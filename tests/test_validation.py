"""generate()'s input checks: what a first call gets wrong, the position limits, per-call seeds, compile off the GPU."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

from cb_sync import CBConfig, SamplingParams, SyncCBDriver

from conftest import VOCAB, hf_greedy, make_model, make_tokenizer, random_prompts


@pytest.fixture(scope="module")
def model():
    return make_model("qwen3")


def no_work_driver(model) -> SyncCBDriver:
    """A driver that fails the test if any step runs."""
    return SyncCBDriver(model, observer=lambda step: pytest.fail("a step ran"))


@pytest.mark.parametrize("prompts,kind", [(None, "NoneType"), (5, "int"), ((p for p in [[1, 2]]), "generator"),
                                          ("1 2 3", "str"), ({0: [1, 2]}, "dict")])
def test_prompts_that_are_not_a_list_raise_value_error(model, prompts, kind):
    with pytest.raises(ValueError, match=f"prompts must be a list of token-id lists, got {kind}$"):
        no_work_driver(model).generate(prompts, SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize("params,match", [
    ({"max_new_tokens": 2}, "params must be a SamplingParams or a list of one per prompt, got dict"),
    ("greedy", "got str"),
    ([SamplingParams(), {"max_new_tokens": 2}], "request 1: params must be SamplingParams, got dict")])
def test_params_of_the_wrong_type_are_named(model, params, match):
    with pytest.raises(ValueError, match=match):
        no_work_driver(model).generate(random_prompts([3, 4]), params)


@pytest.mark.parametrize("prompts,match", [
    ([[1, 2], [3, 1.0]], r"request 1: token 1.0 at position 1 must be an int, got float"),
    ([[True, 2]], "request 0: token True at position 0 must be an int, got bool"),
    ([np.array([1, 2.0])], "request 0: token 1.0 at position 0 must be an int, got float"),
    ([[np.int64(VOCAB)]], rf"request 0: token {VOCAB} at position 0 is not an id in \[0, {VOCAB}\)"),
    ([torch.tensor([3, -1])], r"request 0: token -1 at position 1 is not an id")])
def test_token_errors_say_what_is_wrong(model, prompts, match):
    with pytest.raises(ValueError, match=match):
        no_work_driver(model).generate(prompts, SamplingParams(max_new_tokens=2))


def test_numpy_and_torch_token_ids_are_accepted(model):
    prompts = random_prompts([6, 6])
    driver = SyncCBDriver(model)
    expected = [r.token_ids for r in driver.generate(prompts, SamplingParams(max_new_tokens=4))]
    array = np.array(prompts)                       # what tokenizer(..., return_tensors="np")["input_ids"] gives
    for given in (array, array.astype(np.int32), [[np.int64(t) for t in p] for p in prompts], list(array),
                  torch.tensor(prompts), list(torch.tensor(prompts)), [[torch.tensor(t) for t in p] for p in prompts]):
        results = driver.generate(given, SamplingParams(max_new_tokens=4))
        assert [r.token_ids for r in results] == expected
        assert all(type(t) is int for r in results for t in r.prompt_ids)


def test_params_changed_after_they_were_built_are_checked_again(model):
    params = SamplingParams(max_new_tokens=4)
    params.max_new_tokens = 0
    with pytest.raises(ValueError, match="request 1: max_new_tokens must be a positive int, got 0"):
        no_work_driver(model).generate(random_prompts([3, 4]), [SamplingParams(max_new_tokens=2), params])


def test_a_call_that_fails_its_checks_leaves_the_global_rng_alone(model):
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match="request 1: empty prompt"):
        no_work_driver(model).generate([[1, 2], []], SamplingParams(max_new_tokens=2))
    assert torch.equal(torch.get_rng_state(), state)


def test_token_ids_are_checked_against_the_vocabulary_of_the_call():
    model = make_model("qwen3")
    driver = SyncCBDriver(model)
    driver.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    model.resize_token_embeddings(VOCAB + 8)
    assert driver.generate([[VOCAB + 7, 2]], SamplingParams(max_new_tokens=1))[0].finish_reason == "length"
    model.resize_token_embeddings(VOCAB - 8)
    with pytest.raises(ValueError, match=rf"token {VOCAB - 1} at position 0 is not an id in \[0, {VOCAB - 8}\)"):
        driver.generate([[VOCAB - 1]], SamplingParams(max_new_tokens=1))


def gpt2(n_positions: int):
    from transformers import AutoModelForCausalLM, GPT2Config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(n_positions=n_positions, n_layer=2, n_embd=64, n_head=4,
                                                        vocab_size=VOCAB, initializer_range=0.2)).eval()
    model.generation_config.eos_token_id = None
    return model


def test_learned_positions_bound_is_prompt_plus_new_tokens_minus_one():
    """The last generated token is never fed back: a 64-token prompt fits a 64-position GPT-2 for one new token,
    as in HF generate; a second new token needs position 64."""
    model = gpt2(64)
    driver = SyncCBDriver(model)
    prompt, other = random_prompts([64, 60])
    assert driver.generate([prompt], SamplingParams(max_new_tokens=1))[0].token_ids == hf_greedy(model, prompt, 1)
    assert driver.generate([other], SamplingParams(max_new_tokens=5))[0].token_ids == hf_greedy(model, other, 5)
    with pytest.raises(ValueError, match="request 1: prompt of 64 tokens plus max_new_tokens=2 exceeds the model's "
                                         "64 learned positions"):
        driver.generate([other, prompt], SamplingParams(max_new_tokens=2))


def rotary_model(max_positions: int):
    from transformers import AutoModelForCausalLM, Qwen3Config
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
                         max_position_embeddings=max_positions)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    return model


def test_rotary_model_past_max_position_embeddings_warns_once_and_runs():
    model = rotary_model(32)
    driver = SyncCBDriver(model)
    prompts = random_prompts([30, 31, 5])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        driver.generate(prompts, SamplingParams(max_new_tokens=2))          # 31 + 2 - 1 = 32 positions fit
        driver.generate(prompts[:1], SamplingParams(max_new_tokens=3))      # 30 + 3 - 1 = 32 fit
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = driver.generate(prompts, SamplingParams(max_new_tokens=6))
    assert [str(w.message) for w in caught] == [
        "generating past the model's max_position_embeddings (32): positions beyond it were not trained, the output "
        "may degrade"]
    assert caught[0].filename == __file__                                   # points at the caller's line
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 6) for p in prompts]


def test_call_seed_gives_reproducible_and_distinct_group_members(model):
    prompts = [random_prompts([8])[0]] * 4 + [random_prompts([5], seed=2)[0]] * 4     # two GRPO groups of 4
    params = SamplingParams(max_new_tokens=12, do_sample=True, temperature=2.0)
    driver = SyncCBDriver(model)
    state = torch.get_rng_state()
    first = driver.generate(prompts, params, seed=1234)
    again = driver.generate(prompts, params, seed=1234)
    other = driver.generate(prompts, params, seed=4321)
    assert torch.equal(state, torch.get_rng_state())                        # the global RNG is left alone
    tokens = [tuple(r.token_ids) for r in first]
    assert tokens == [tuple(r.token_ids) for r in again]
    assert len(set(tokens[:4])) == 4 and len(set(tokens[4:])) == 4
    assert tokens != [tuple(r.token_ids) for r in other]
    assert len({r.seed for r in first}) == 8
    # a request's own seed wins over the call's; a result's seed replays that request
    own = driver.generate(prompts[:2], [SamplingParams(max_new_tokens=12, do_sample=True, temperature=2.0,
                                                       seed=first[1].seed), params], seed=99)
    assert own[0].token_ids == first[1].token_ids and own[0].seed == first[1].seed


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True, "7"])
def test_bad_call_seed(model, seed):
    with pytest.raises(ValueError, match="seed must be None or an int in"):
        no_work_driver(model).generate(random_prompts([3]), SamplingParams(max_new_tokens=2), seed=seed)


@pytest.mark.parametrize("config", [CBConfig(compile=True), CBConfig(compile=True, attn_backend="sdpa_paged")])
def test_compile_where_it_cannot_apply_warns_once(model, config):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):
            SyncCBDriver(model, config)
    assert len(caught) == 1 and issubclass(caught[0].category, UserWarning)
    assert "CBConfig(compile=True) is ignored on cpu" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SyncCBDriver(model, CBConfig())


@pytest.mark.parametrize("fails", [{"max_new_tokens": 10**9}, {"max_new_tokens": 40, "num_blocks": 2}])
def test_a_call_that_fails_its_checks_gives_no_warning_first(fails):
    """Past max_position_embeddings and refused: the ValueError comes alone, not after the rotary warning."""
    num_blocks = fails.pop("num_blocks", None)
    driver = SyncCBDriver(rotary_model(32), CBConfig(num_blocks=num_blocks), observer=lambda step: pytest.fail())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="KV blocks"):
            driver.generate(random_prompts([30, 5]), SamplingParams(**fails))
    assert [str(w.message) for w in caught] == []


TEXTS = ["t5 t17 t33 t9", "t100", "t64 t3 t77 t2 t90 t41", "t7 t7"]


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_a_padded_batch_generates_from_each_rows_unmasked_tokens(model, padding_side):
    """What the tokenizer gives for a padded batch, in every form it comes: each row is cut to its unmasked tokens,
    as if the prompts had come unpadded."""
    from transformers import BatchEncoding
    tokenizer = make_tokenizer(padding_side)
    unpadded = [tokenizer(text)["input_ids"] for text in TEXTS]
    driver = SyncCBDriver(model)
    params = SamplingParams(max_new_tokens=5)
    expected = [r.token_ids for r in driver.generate(unpadded, params)]
    encoding = tokenizer(TEXTS, padding=True, return_tensors="pt")
    ids, mask = encoding["input_ids"], encoding["attention_mask"]
    assert isinstance(encoding, BatchEncoding) and (mask == 0).any()
    for given, extra in [(encoding, {}), (dict(encoding), {}), (tokenizer(TEXTS, padding=True), {}),
                         (tokenizer(TEXTS, padding=True, return_tensors="np"), {}), (ids, {"attention_mask": mask}),
                         (ids.numpy(), {"attention_mask": mask.numpy().astype(bool)}),
                         (ids.tolist(), {"attention_mask": mask.tolist()})]:
        results = driver.generate(given, params, **extra)
        assert [r.prompt_ids for r in results] == unpadded
        assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("given,mask,match", [
    ({"input_ids": [[1, 2]], "attention_mask": [[1, 1]]}, [[1, 1]],
     "attention_mask given twice: in the prompts' encoding and as an argument"),
    (torch.tensor([[1, 2], [3, 4]]), torch.ones(3, 2, dtype=torch.long), "attention_mask has 3 rows for 2 prompts"),
    ([[1, 2], [3, 4, 5]], [[1, 1], [1, 1]], "request 1: attention_mask row of 2 values for a prompt of 3 tokens"),
    (torch.tensor([[1, 2]]), torch.tensor([[1, 2]]), "request 0: attention_mask values must be 0 or 1, got 2"),
    (torch.tensor([[1, 2]]), torch.tensor([[0.5, 1.0]]), "request 0: attention_mask values must be 0 or 1, got 0.5"),
    (torch.tensor([[1, 2, 3]]), torch.tensor([[1, 0, 1]]),
     r"request 0: attention_mask \[1, 0, 1\] is not one run of 1s \(left or right padding\)"),
    (torch.tensor([[1, 2], [3, 4]]), torch.tensor([[1, 1], [0, 0]]), "request 1: empty prompt"),
    ([[1, 2]], 5, "attention_mask must be a list of 0/1 rows, got int"),
    ({"attention_mask": [[1, 1]]}, None, "prompts must be a list of token-id lists, got dict")])
def test_bad_attention_masks_are_named_before_any_work(model, given, mask, match):
    with pytest.raises(ValueError, match=match):
        no_work_driver(model).generate(given, SamplingParams(max_new_tokens=2), attention_mask=mask)


def test_a_padded_2d_prompt_without_a_mask_is_refused():
    """make_model's pad token is 0: a 2-D prompt whose rows start or end with it is padded, and without its
    attention_mask refused; lists, unpadded rows, or a model with neither a pad token nor an EOS run."""
    model = make_model("qwen3")
    padded = [[0, 0, 5, 6], [7, 8, 9, 0], [3, 4, 5, 6], [0, 1, 2, 3]]
    for given in (torch.tensor(padded), np.array(padded), {"input_ids": torch.tensor(padded)}):
        with pytest.raises(ValueError, match=re.escape(
                "rows [0, 1, 3] of the 2-D prompt start or end with the pad token id 0 and come without an "
                "attention_mask: pass the tokenizer's encoding whole (input_ids and attention_mask), attention_mask=, "
                "or the prompts unpadded as lists of token ids")):
            no_work_driver(model).generate(given, SamplingParams(max_new_tokens=2))
    params = SamplingParams(max_new_tokens=2)
    SyncCBDriver(model).generate(torch.tensor([[3, 4, 0, 6], [1, 2, 3, 4]]), params)
    SyncCBDriver(model).generate(padded, params)
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = 6            # no pad token: HF generate pads with the EOS
    with pytest.raises(ValueError, match=r"rows \[0, 2\] of the 2-D prompt start or end with the pad token id 6"):
        no_work_driver(model).generate(torch.tensor(padded), params)
    model.generation_config.eos_token_id = None
    assert model.config.pad_token_id is None
    SyncCBDriver(model).generate(torch.tensor(padded), params)


def test_suppress_tokens_that_leave_no_token_to_choose_are_refused(model):
    everything = SamplingParams(max_new_tokens=2, suppress_tokens=list(range(VOCAB)))
    with pytest.raises(ValueError, match=f"request 1: suppress_tokens cover all {VOCAB} token ids: no token is "
                                         "left to choose"):
        no_work_driver(model).generate(random_prompts([3, 4]), [SamplingParams(max_new_tokens=2), everything])
    but_eos = SamplingParams(max_new_tokens=4, suppress_tokens=list(range(1, VOCAB)), eos_token_id=0,
                             min_new_tokens=1, do_sample=True)
    with pytest.raises(ValueError, match=f"request 0: suppress_tokens, with the EOS and stop ids min_new_tokens=1 "
                                         f"masks, cover all {VOCAB} token ids: no token is left to choose"):
        no_work_driver(model).generate(random_prompts([3]), but_eos)
    for sample in (False, True):
        one_left = SamplingParams(max_new_tokens=3, suppress_tokens=list(range(1, VOCAB)), do_sample=sample)
        assert SyncCBDriver(model).generate(random_prompts([3]), one_left, seed=0)[0].token_ids == [0, 0, 0]
