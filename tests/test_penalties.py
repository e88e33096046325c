"""Repetition, frequency and presence penalties, min_new_tokens and suppress_tokens: HF's processors and vLLM's
definitions on the same logits, HF generate's greedy tokens, and every path (eager, the static-buffer path that CUDA
graphs replay, steps launched ahead and redone, preemption, shared prefixes, the exact mode) against the others."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessor, LogitsProcessorList, MinLengthLogitsProcessor,
                                                    MinNewTokensLengthLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor, SuppressTokensLogitsProcessor)

from cb_sync import CBConfig, SamplingParams, SyncCBDriver
from cb_sync.sampling.penalties import (PENALTY_COLUMNS, PenaltyBatch, TokenHistory, apply_penalties, penalty_columns,
                                        penalty_kind)
from cb_sync.scheduler import FIFOScheduler, Request

from conftest import StepLog, make_model, random_prompts

PENALTIES = {"repetition": dict(repetition_penalty=1.3), "encouraged": dict(repetition_penalty=0.7),
             "counts": dict(frequency_penalty=0.6, presence_penalty=0.4), "suppress": dict(suppress_tokens=[3, 7, 64]),
             "min_new": dict(min_new_tokens=12),
             "all": dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=-0.2, min_new_tokens=8,
                         suppress_tokens=[5])}


def _request(prompt, output=(), eos=(), **params) -> Request:
    request = Request(0, list(prompt), SamplingParams(**params), 0, frozenset(eos))
    request.output = list(output)
    return request


def _penalised(requests: list[Request], scores: torch.Tensor, block_size: int = 2) -> torch.Tensor:
    """apply_penalties on scores [S, V] for requests about to sample their next output: each request's tokens stored
    at the slots of its own blocks, handed out in reverse (the block table is followed, not the positions)."""
    width = max(-(-r.num_tokens // block_size) for r in requests)
    history = TokenHistory(block_size, torch.device("cpu"))
    history.ensure(len(requests) * width * block_size)
    tables = []
    for row, request in enumerate(requests):
        blocks = list(range((row + 1) * width - 1, row * width - 1, -1))
        tables.append(blocks)
        slots = [blocks[p // block_size] * block_size + p % block_size for p in range(request.num_tokens)]
        history.record(torch.tensor(slots), torch.tensor(request.prompt + request.output))
    positions = [len(r.output) for r in requests]
    kind = penalty_kind(requests)
    columns = penalty_columns(requests, positions, list(range(len(requests))), kind.banned_width)
    batch = PenaltyBatch(kind, *(torch.tensor(columns[name], dtype=dtype) for name, dtype in PENALTY_COLUMNS.items()),
                         torch.tensor(columns["banned"], dtype=torch.int64).view(len(requests), -1),
                         torch.tensor(tables, dtype=torch.int32), history)
    return apply_penalties(scores.clone(), batch, torch.tensor(positions))


def test_scores_equal_hfs_processors_applied_to_each_history():
    """transformers' own expectation for its continuous batching (each history processed alone by HF's processor),
    here on cb_sync's penalties: the repetition penalty (over prompt and output), min_length and min_new_tokens (EOS
    masked; min_length as the drop-in maps it), suppress_tokens, alone and chained in generate's order; bit for
    bit."""
    histories, eos = [[4, 5, 4], [1, 2, 1, 2]], 9
    scores = torch.arange(20, dtype=torch.float32).view(2, 10) - 7       # negative, zero and positive logits
    cases = [
        (lambda: [RepetitionPenaltyLogitsProcessor(1.2)], [dict(repetition_penalty=1.2)] * 2, [1, 3]),
        (lambda: [MinLengthLogitsProcessor(4, eos_token_id=eos)], [dict(min_new_tokens=1), {}], [3, 4]),
        (lambda: [MinNewTokensLengthLogitsProcessor(2, 2, eos_token_id=eos)], [dict(min_new_tokens=2)] * 2, [2, 2]),
        (lambda: [SuppressTokensLogitsProcessor([3, 6])], [dict(suppress_tokens=[3, 6])] * 2, [3, 4]),
        (lambda: [RepetitionPenaltyLogitsProcessor(0.8), MinNewTokensLengthLogitsProcessor(2, 3, eos_token_id=eos),
                  SuppressTokensLogitsProcessor([1])],
         [dict(repetition_penalty=0.8, min_new_tokens=3, suppress_tokens=[1])] * 2, [2, 2]),
    ]
    for processors, params, prompt_lens in cases:
        expected = torch.cat([LogitsProcessorList(processors())(torch.tensor([h]), row[None].clone())
                              for h, row in zip(histories, scores)])
        requests = [_request(h[:n], h[n:], eos=[eos], **p) for h, n, p in zip(histories, prompt_lens, params)]
        assert torch.equal(_penalised(requests, scores), expected)


def test_frequency_and_presence_penalties_are_vllms_over_the_output_only():
    """vLLM's definition, after its repetition penalty: logits -= frequency * count; logits -= presence * (count >
    0), counts over the output tokens (the prompt's count for the repetition penalty only); a row's scores are the
    same bits alone as in the batch."""
    gen = torch.Generator().manual_seed(0)
    vocab = 50
    scores = torch.randn(4, vocab, generator=gen) * 3
    requests = []
    for row in range(4):
        prompt = torch.randint(0, vocab, (2 + 3 * row,), generator=gen).tolist()
        output = torch.randint(0, 8, (5 * row,), generator=gen).tolist()
        requests.append(_request(prompt, output, repetition_penalty=[1.0, 1.5, 0.9, 2.0][row],
                                 frequency_penalty=[0.5, 0.0, -0.3, 1.2][row],
                                 presence_penalty=[0.0, 0.7, 0.2, 1.0][row]))
    got = _penalised(requests, scores)
    for row, request in enumerate(requests):
        p = request.params
        expected = scores[row].clone()
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[request.prompt + request.output] = True
        expected = torch.where(seen, torch.where(expected < 0, expected * p.repetition_penalty,
                                                 expected / p.repetition_penalty), expected)
        counts = torch.bincount(torch.tensor(request.output, dtype=torch.int64), minlength=vocab).float()
        expected = expected - p.frequency_penalty * counts
        expected = expected - p.presence_penalty * (counts > 0)
        assert torch.equal(got[row], expected)
        assert torch.equal(_penalised([request], scores[row:row + 1])[0], got[row])


class _CountPenalties(LogitsProcessor):
    """vLLM's frequency and presence penalties as an HF logits processor (HF has none), for generate's loop."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        counts = torch.bincount(input_ids[0, self.prompt_len:], minlength=scores.shape[1]).float()[None]
        return scores - self.frequency * counts - self.presence * (counts > 0)


def _hf_greedy(model, prompt: list[int], n: int, eos=None, frequency_penalty=0.0, presence_penalty=0.0,
               **options) -> list[int]:
    """HF generate's greedy tokens; vLLM's penalties run after HF's own processors (the masks commute with them)."""
    counts = LogitsProcessorList([_CountPenalties(len(prompt), frequency_penalty, presence_penalty)])
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                                         dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0,
                             logits_processor=counts, **options)
    tokens = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


@pytest.mark.parametrize("static_decode", [None, True])
@pytest.mark.parametrize("name", sorted(PENALTIES))
def test_greedy_tokens_equal_hf_generate_with_the_same_options(name, static_decode):
    """Eager steps and the graphs' static-buffer path, chunked prefill, against HF generate with the option (vLLM's
    frequency and presence penalties as a logits processor of the test's)."""
    model = make_model("qwen3")
    prompts = random_prompts([3, 20, 41])
    eos = SyncCBDriver(model).generate(prompts[:1], SamplingParams(max_new_tokens=4))[0].token_ids[3]
    driver = SyncCBDriver(model, CBConfig(block_size=8, max_batch_tokens=16), static_decode=static_decode)
    results = driver.generate(prompts, SamplingParams(max_new_tokens=24, eos_token_id=eos, **PENALTIES[name]))
    tokens = [r.token_ids for r in results]
    assert tokens == [_hf_greedy(model, p, 24, eos, **PENALTIES[name]) for p in prompts]
    assert tokens != [_hf_greedy(model, p, 24, eos) for p in prompts]       # the option changed the tokens


@pytest.mark.slow
def test_compiled_steps_give_hf_generates_tokens():
    """The compiled step (its Triton kernels through the interpreter on the CPU): chunked prefill and mixed steps
    compiled, decode steps compiled in the static-buffer path, each storing its tokens; HF generate's tokens."""
    pytest.importorskip("triton")
    model = make_model("qwen3", lora=True)
    prompts = random_prompts([3, 20, 41])
    eos = SyncCBDriver(model).generate(prompts[:1], SamplingParams(max_new_tokens=4))[0].token_ids[3]
    driver = SyncCBDriver(model, CBConfig(max_batch_size=4, block_size=8, max_batch_tokens=16, attn_backend="triton",
                                          compile=True), static_decode=True)
    results = driver.generate(prompts, SamplingParams(max_new_tokens=10, eos_token_id=eos, **PENALTIES["all"]))
    assert driver.runner.replay.forward.active and driver.runner.replay.graphs.graphs
    assert [r.token_ids for r in results] == [_hf_greedy(model, p, 10, eos, **PENALTIES["all"]) for p in prompts]


def test_sampled_tokens_respect_the_masks():
    """Seeded sampling: a suppressed token is never drawn, EOS and stop tokens not before min_new_tokens."""
    model = make_model("llama")
    prompts = random_prompts([4, 9, 17, 30] * 4)
    sampling = dict(max_new_tokens=16, do_sample=True, temperature=2.0, seed=3)
    free = [t for r in SyncCBDriver(model).generate(prompts, SamplingParams(**sampling)) for t in r.token_ids]
    common, eos, stop = sorted(set(free), key=free.count, reverse=True)[:3]
    params = SamplingParams(**sampling, eos_token_id=eos, stop_token_ids=[stop])
    assert min(len(r.token_ids) for r in SyncCBDriver(model).generate(prompts, params)) < 10
    params = SamplingParams(**sampling, eos_token_id=eos, stop_token_ids=[stop], min_new_tokens=10,
                            suppress_tokens=[common])
    results = SyncCBDriver(model, static_decode=True).generate(prompts, params)
    assert all(common not in r.token_ids for r in results)
    assert all(len(r.token_ids) > 10 or r.finish_reason == "length" for r in results)
    assert any(r.finish_reason in ("eos", "stop") for r in results)


def _seeded(seed, **options):
    return SamplingParams(**{**dict(max_new_tokens=20, do_sample=True, temperature=1.2, top_k=8, seed=seed,
                                    logprobs=True), **options})


@pytest.mark.parametrize("trial", range(6))
def test_steps_launched_ahead_equal_eager_and_one_by_one_steps_on_random_workloads(trial, monkeypatch):
    """Random workloads with penalties on some requests (every term, greedy and sampled): repeated prompts (shared
    prefix blocks), stop and EOS tokens, a small cache that preempts, more requests than the batch holds. Steps
    launched ahead equal eager steps and static-buffer steps run one at a time."""
    gen = torch.Generator().manual_seed(trial)
    randint = lambda low, high: int(torch.randint(low, high, (1,), generator=gen))
    model = make_model(["llama", "qwen3"][trial % 2])
    distinct = random_prompts([randint(3, 30) for _ in range(4)], seed=trial)
    prompts = [distinct[randint(0, 4)] for _ in range(randint(5, 9))]
    samplers = [dict(do_sample=False), dict(do_sample=True), dict(do_sample=True, top_k=0, top_p=0.9)]
    names = [None, *sorted(PENALTIES)]
    params = [_seeded(i, **{**samplers[randint(0, 3)], **PENALTIES.get(names[randint(0, len(names))], {}),
                            "eos_token_id": randint(0, 128), "stop_token_ids": [randint(0, 128)]})
              for i in range(len(prompts))]
    config = CBConfig(max_batch_size=randint(2, 5), block_size=4, max_batch_tokens=randint(8, 64), num_blocks=16)
    steps = StepLog()
    ahead = SyncCBDriver(model, config, static_decode=True, observer=steps).generate(prompts, params)
    eager = SyncCBDriver(model, config).generate(prompts, params)
    assert any(step.ahead for step in steps if step.path == "replay")
    monkeypatch.setattr(FIFOScheduler, "plan_ahead", lambda self, plan: None)
    one_by_one = SyncCBDriver(model, config, static_decode=True).generate(prompts, params)
    for other in (eager, one_by_one):
        assert [r.token_ids for r in ahead] == [r.token_ids for r in other]
        assert [r.finish_reason for r in ahead] == [r.finish_reason for r in other]
        for a, b in zip(ahead, other):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


def test_a_step_redone_after_a_tie_and_the_step_relaunched_after_it_store_the_right_tokens():
    """All logits equal: the candidates' step is redone over the sorted vocabulary and the step launched ahead of it,
    which stored the tie's token, is launched again; the frequency penalty, which reads every stored output token,
    gives the eager path's draws."""
    model = make_model("llama")
    with torch.no_grad():
        model.lm_head.weight.zero_()
    prompts = random_prompts([5, 12, 30])
    params = [SamplingParams(max_new_tokens=40, do_sample=True, top_k=5, seed=s, frequency_penalty=0.5,
                             repetition_penalty=1.5) for s in (1, 2, 3)]
    steps = StepLog()
    static = SyncCBDriver(model, static_decode=True, observer=steps).generate(prompts, params)
    eager = SyncCBDriver(model).generate(prompts, params)
    assert any(step.redone for step in steps if step.path == "replay")
    assert any(step.relaunched for step in steps if step.path == "replay")
    assert [r.token_ids for r in static] == [r.token_ids for r in eager]


def test_preempted_requests_are_recomputed_with_their_history():
    """A cache too small for the batch: preempted requests come back from their prompt and kept tokens, and their
    penalties see the same history; greedy tokens equal HF generate's."""
    model = make_model("qwen3")
    prompts = random_prompts([40, 9, 70, 25, 2, 33])
    preempted = []
    driver = SyncCBDriver(model, CBConfig(block_size=8, num_blocks=16, max_batch_tokens=24, max_batch_size=4),
                          static_decode=True,
                          observer=lambda step: preempted.extend(c.request.num_preemptions for c in step.plan))
    results = driver.generate(prompts, SamplingParams(max_new_tokens=24, repetition_penalty=1.4))
    assert max(preempted) > 0
    assert [r.token_ids for r in results] == [_hf_greedy(model, p, 24, repetition_penalty=1.4) for p in prompts]


@pytest.mark.parametrize("static_decode", [None, True])
def test_exact_mode_a_penalised_request_is_bit_identical_alone_and_in_any_batch(static_decode):
    """The exact mode: a request with every term is the same bits alone and in a batch with chunked prefill,
    preemption and other requests with or without penalties; a request without penalties is the same bits in a call
    whose other requests use them as in a call where none does."""
    model = make_model("qwen3", lora=True)
    target, plain = random_prompts([37, 23], seed=4)
    params = _seeded(11, **PENALTIES["all"])
    alone = SyncCBDriver(model, CBConfig(batch_invariant=True), static_decode=static_decode)
    others = random_prompts([5, 60, 14, 41, 8], seed=5)
    preempted = []
    driver = SyncCBDriver(model, CBConfig(batch_invariant=True, block_size=8, num_blocks=16, max_batch_tokens=16,
                                          max_batch_size=4), static_decode=static_decode,
                          observer=lambda step: preempted.extend(c.request.num_preemptions for c in step.plan))
    mixed = [_seeded(i, **PENALTIES[name]) for i, name in enumerate(["counts", "suppress"])] + [
        params, _seeded(3)] + [SamplingParams(max_new_tokens=20, logprobs=True)] * 3
    results = driver.generate(others[:2] + [target, plain] + others[2:], mixed)
    assert max(preempted) > 0
    expected = alone.generate([target], params)[0]
    assert results[2].token_ids == expected.token_ids and results[2].logprobs == expected.logprobs
    expected = alone.generate([plain], _seeded(3))[0]
    assert results[3].token_ids == expected.token_ids and results[3].logprobs == expected.logprobs


def test_logprobs_are_the_models_before_penalties_and_masks():
    """Logprobs are log_softmax(logits / temperature) of the model's logits over the whole vocabulary (what a trainer
    recomputes), whatever the penalties and masks did to the draw."""
    model = make_model("qwen2")
    prompts = random_prompts([5, 18, 40])
    params = SamplingParams(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=10, logprobs=True,
                            repetition_penalty=2.0, frequency_penalty=1.0, suppress_tokens=[1, 2])
    results = SyncCBDriver(model, CBConfig(block_size=8, max_batch_tokens=20)).generate(prompts, params)
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + result.token_ids])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits / 0.8, dim=-1).gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-4)


def test_neutral_values_add_no_buffers_graphs_or_history():
    """Calls whose requests use no penalty run the buffers and graphs they ran before any call used one; a call
    with penalties adds its own (keys with its PenaltyKind) and the token history, kept with the graphs."""
    model = make_model("llama")
    driver = SyncCBDriver(model, CBConfig(max_batch_size=4), static_decode=True)
    replay, prompts = driver.runner.replay, random_prompts([6, 9])
    plain, penalised = SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=4, repetition_penalty=1.2)
    driver.generate(prompts, plain)
    assert driver.runner.penalties is None and driver.runner.history.ids is None
    assert not any(name.startswith("penalty.") for name in replay.buffers.views)
    assert all(len(key) == 2 for key in replay.graphs.graphs)
    driver.generate(prompts, penalised)
    assert "penalty.repetition" in replay.buffers.views
    assert {key[2] for key in replay.graphs.graphs if len(key) == 3} == {penalty_kind(
        [_request([1], repetition_penalty=1.2)])}
    driver.generate(prompts, plain)
    captured, history = dict(replay.graphs.graphs), driver.runner.history.ids
    driver.generate(prompts, penalised)
    driver.generate(prompts, plain)
    assert {len(key) for key in captured} == {2, 3}
    assert replay.graphs.graphs == captured
    driver.release(keep_graphs=True)
    assert driver.runner.history.ids is history
    driver.release()
    assert driver.runner.history.ids is None and not replay.graphs.graphs


def test_bad_values_name_the_field_and_the_request():
    for options, message in [(dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
                             (dict(repetition_penalty=float("inf")), "repetition_penalty"),
                             (dict(frequency_penalty=float("nan")), "frequency_penalty must be a finite number"),
                             (dict(presence_penalty="0.5"), "presence_penalty"),
                             (dict(min_new_tokens=5, max_new_tokens=4), r"min_new_tokens must be an int in \[0, "),
                             (dict(min_new_tokens=1.5), "min_new_tokens"),
                             (dict(suppress_tokens=3), "suppress_tokens must be a list"),
                             (dict(suppress_tokens=[-1]), "suppress_tokens must hold ints >= 0")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**options)
    model = make_model("llama")
    with pytest.raises(ValueError, match=r"request 1: suppress_tokens \[128\] are not ids in \[0, 128\)"):
        SyncCBDriver(model).generate(random_prompts([3, 4]),
                                     [SamplingParams(), SamplingParams(suppress_tokens=[5, 128])])
