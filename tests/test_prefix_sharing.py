"""Group prefill: identical prompt prefixes share full KV blocks, so a GRPO group's prompt is prefilled once."""

from __future__ import annotations

from cb_sync import CBConfig, SamplingParams, SyncCBDriver

from conftest import StepLog, hf_greedy, make_model, random_prompts


def _prefill_tokens(model, config, prompts, params):
    steps = StepLog()
    results = SyncCBDriver(model, config, observer=steps).generate(prompts, params)
    return sum(min(c.length, max(len(c.request.prompt) - c.start, 0)) for step in steps for c in step.plan), results


def test_group_prompt_is_prefilled_once():
    model = make_model("qwen3")
    prompt = random_prompts([40])[0]
    other = random_prompts([21], seed=5)[0]
    prompts = [prompt] * 4 + [other] * 2
    params = SamplingParams(max_new_tokens=6)
    tokens_shared, results = _prefill_tokens(model, CBConfig(block_size=8, max_batch_tokens=256), prompts, params)
    tokens_private, baseline = _prefill_tokens(model, CBConfig(block_size=8, max_batch_tokens=256,
                                                               prefix_sharing=False), prompts, params)
    assert tokens_private == 4 * 40 + 2 * 21
    assert tokens_shared == 40 + 3 * (40 - 32) + 21 + (21 - 16)
    expected = [hf_greedy(model, p, 6) for p in (prompt, other)]
    assert [r.token_ids for r in results] == [expected[0]] * 4 + [expected[1]] * 2
    assert [r.token_ids for r in baseline] == [r.token_ids for r in results]


def test_sampled_group_members_differ_with_shared_prefix():
    model = make_model("llama")
    prompt = random_prompts([33])[0]
    results = SyncCBDriver(model, CBConfig(block_size=8)).generate(
        [prompt] * 4, SamplingParams(max_new_tokens=10, do_sample=True, temperature=2.0))
    assert len({tuple(r.token_ids) for r in results}) > 1
