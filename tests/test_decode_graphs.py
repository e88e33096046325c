"""The static-buffer decode path (what CUDA graphs replay), run on the CPU against HF and the eager path."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from cb_sync import CBConfig, SamplingParams, SyncCBDriver
from cb_sync.cache.paged_cache import offsets_to_pools
from cb_sync.graphs import compiled, model_fingerprint
from cb_sync.model_patching.swaps import module_list
from cb_sync.sampling.sampler import CANDIDATES, MAX_CANDIDATE_TOP_K, SamplerKind, sampler_kind

from conftest import StepLog, hf_greedy, make_model, random_prompts


def _driver_with_static_path(model, steps: StepLog | None = None, **config):
    """A driver whose pure-decode steps run the static-buffer path (captured graphs on CUDA) on the CPU."""
    return SyncCBDriver(model, CBConfig(**config), static_decode=True, observer=steps)


def _replays(steps: StepLog) -> list:
    return [step for step in steps if step.path == "replay"]


def _compiled_static_path(model, max_batch_size=4, steps: StepLog | None = None, **config):
    return SyncCBDriver(model, CBConfig(max_batch_size=max_batch_size, block_size=8, attn_backend="triton",
                                        compile=True, **config), static_decode=True, observer=steps)


def test_static_decode_path_matches_hf_greedy_on_every_architecture(arch):
    model = make_model(arch, lora=True)
    prompts = random_prompts([3, 20, 41])
    results = _driver_with_static_path(model, max_batch_size=8, block_size=8).generate(
        prompts, SamplingParams(max_new_tokens=6))
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 6) for p in prompts]


def test_static_decode_path_matches_hf_greedy():
    model = make_model("qwen3", lora=True)
    prompts = random_prompts([3, 20, 41, 9, 17])
    steps = StepLog()
    driver = _driver_with_static_path(model, steps, max_batch_size=8, block_size=8)
    results = driver.generate(prompts, [SamplingParams(max_new_tokens=n) for n in (12, 7, 10, 3, 9)])
    assert max((len(step.plan), step.ahead) for step in _replays(steps)) == (5, True)
    for prompt, n, result in zip(prompts, (12, 7, 10, 3, 9), results):
        assert result.token_ids == hf_greedy(model, prompt, n)


def test_static_path_sampling_equals_eager_path():
    model = make_model("llama")
    prompts = random_prompts([5, 12, 30])
    params = [SamplingParams(max_new_tokens=10, do_sample=True, temperature=1.3, top_k=20, top_p=0.9, seed=s,
                             logprobs=True) for s in (1, 2, 3)]
    static = _driver_with_static_path(model).generate(prompts, params)
    eager = SyncCBDriver(model).generate(prompts, params)
    assert [r.token_ids for r in static] == [r.token_ids for r in eager]
    torch.testing.assert_close(torch.tensor([r.logprobs for r in static]), torch.tensor([r.logprobs for r in eager]))


@pytest.mark.parametrize("sampler", [{}, {"do_sample": True}, {"do_sample": True, "top_k": 5}])
def test_steps_launched_ahead_drop_the_rows_of_requests_ended_by_a_stop_token(sampler):
    """Decode steps launched before the previous step's tokens are read: requests that end on a stop token (a
    row already computed past their end), others that wait for a place in the batch, and lengths that end the
    chain; tokens, logprobs and finish reasons equal to the eager path's (greedy, sampling, the candidates'
    sampler)."""
    model = make_model("llama")
    prompts = random_prompts([5, 12, 30, 7, 19, 3])
    eager = SyncCBDriver(model, CBConfig(max_batch_size=3, block_size=4)).generate(
        prompts, SamplingParams(max_new_tokens=30, seed=5, logprobs=True, **sampler))
    common = [t for t, _ in Counter(t for r in eager for t in r.token_ids[2:]).most_common(2)]
    params = [SamplingParams(max_new_tokens=n, seed=5, logprobs=True, stop_token_ids=common, **sampler)
              for n in (30, 9, 30, 4, 30, 17)]
    steps = StepLog()
    static = _driver_with_static_path(model, steps, max_batch_size=3, block_size=4).generate(prompts, params)
    reference = SyncCBDriver(model, CBConfig(max_batch_size=3, block_size=4)).generate(prompts, params)
    ahead = [step.ahead for step in _replays(steps)]
    assert sum(ahead) >= 5 and not all(ahead)
    assert all(step.host.is_contiguous() for step in _replays(steps))   # a strided host view: a synchronous copy
    assert any(r.finish_reason == "stop" and len(r.token_ids) < p.max_new_tokens for r, p in zip(static, params))
    assert [r.token_ids for r in static] == [r.token_ids for r in reference]
    assert [r.finish_reason for r in static] == [r.finish_reason for r in reference]
    for a, b in zip(static, reference):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


@pytest.mark.parametrize("trial", range(12))
def test_steps_launched_ahead_match_the_eager_path_on_random_workloads(trial):
    """Random workloads through steps launched ahead: repeated prompts (shared prefix blocks), stop and EOS tokens,
    mixed samplers, a small cache that forces preemption, more requests than the batch holds."""
    gen = torch.Generator().manual_seed(trial)
    randint = lambda low, high: int(torch.randint(low, high, (1,), generator=gen))
    model = make_model(["llama", "qwen3"][trial % 2])
    distinct = random_prompts([randint(3, 30) for _ in range(4)], seed=trial)
    prompts = [distinct[randint(0, 4)] for _ in range(randint(5, 9))]
    samplers = [{}, {"do_sample": True}, {"do_sample": True, "top_k": 5}, {"do_sample": True, "top_p": 0.9}]
    params = [SamplingParams(max_new_tokens=randint(1, 25), seed=i, logprobs=True, eos_token_id=randint(0, 128),
                             stop_token_ids=[randint(0, 128)], **samplers[randint(0, 4)]) for i in range(len(prompts))]
    config = dict(max_batch_size=randint(2, 5), block_size=4, max_batch_tokens=randint(8, 64), num_blocks=16)
    steps = StepLog()
    static = _driver_with_static_path(model, steps, **config).generate(prompts, params)
    reference = SyncCBDriver(model, CBConfig(**config)).generate(prompts, params)
    assert any(step.ahead for step in _replays(steps))
    assert [r.token_ids for r in static] == [r.token_ids for r in reference]
    assert [r.finish_reason for r in static] == [r.finish_reason for r in reference]
    for a, b in zip(static, reference):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


def test_sampler_kind():
    kind = SamplerKind
    assert sampler_kind([SamplingParams()]) is kind.GREEDY
    assert sampler_kind([SamplingParams(), SamplingParams(do_sample=True)]) is kind.SAMPLE
    assert sampler_kind([SamplingParams(do_sample=True), SamplingParams(do_sample=True, min_p=0.1)]) is kind.SORTED
    grpo = SamplingParams(do_sample=True, temperature=0.1, top_k=5, top_p=0.97, min_p=0.5)
    assert sampler_kind([grpo, SamplingParams()]) is kind.CANDIDATES
    assert sampler_kind([grpo, SamplingParams(do_sample=True, top_k=MAX_CANDIDATE_TOP_K)]) is kind.CANDIDATES
    assert sampler_kind([grpo, SamplingParams(do_sample=True, top_k=MAX_CANDIDATE_TOP_K + 1)]) is kind.SORTED
    assert sampler_kind([grpo, SamplingParams(do_sample=True, top_p=0.9)]) is kind.SORTED


def test_static_path_top_k_ties_past_the_candidates_sample_the_whole_tie():
    """All logits equal: top-k keeps the whole vocabulary, so the candidates' step is redone over the sorted
    vocabulary, as the eager path does, and draws reach tokens outside the first CANDIDATES. The step launched
    ahead of a redone one read the tie's token: it is marked stale and launched again."""
    model = make_model("llama")
    with torch.no_grad():
        model.lm_head.weight.zero_()
    prompts = random_prompts([5, 12, 30])
    params = [SamplingParams(max_new_tokens=40, do_sample=True, top_k=5, seed=s) for s in (1, 2, 3)]
    steps = StepLog()
    static = _driver_with_static_path(model, steps).generate(prompts, params)
    eager = SyncCBDriver(model).generate(prompts, params)
    assert all(step.kind is SamplerKind.CANDIDATES for step in _replays(steps))
    assert any(step.redone for step in _replays(steps))
    assert any(step.relaunched for step in _replays(steps))
    assert [r.token_ids for r in static] == [r.token_ids for r in eager]
    assert len({t for r in static for t in r.token_ids}) > CANDIDATES


@pytest.mark.parametrize("static", [False, True])
def test_a_request_draws_the_same_tokens_alone_and_next_to_one_needing_the_sorted_vocabulary(static):
    """Logits tied in pairs (tokens i and i + 64 share a row of lm_head): a top-k request keeps its tokens when a
    top_k=0 request joins the batch and the step's sampler changes."""
    model = make_model("llama")
    with torch.no_grad():
        model.lm_head.weight[64:] = model.lm_head.weight[:64]
    prompts = random_prompts([7, 9])
    a = SamplingParams(max_new_tokens=40, do_sample=True, top_k=20, top_p=0.5, seed=1)
    b = SamplingParams(max_new_tokens=40, do_sample=True, top_p=0.9, seed=2)
    make = _driver_with_static_path if static else SyncCBDriver
    alone = make(model).generate(prompts[:1], [a])[0].token_ids
    together = make(model).generate(prompts, [a, b])[0].token_ids
    assert alone == together


def test_graphs_invalidated_by_storage_swap_and_width_not_by_in_place_update():
    model = make_model("qwen3", lora=True)
    driver = _driver_with_static_path(model)
    replay, params = driver.runner.replay, SamplingParams(max_new_tokens=4)
    driver.generate(random_prompts([6, 6]), params)
    captured = dict(replay.graphs.graphs)
    assert captured
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.0)                                  # in place: same storage, graphs kept
    driver.generate(random_prompts([6, 6]), params)
    assert replay.graphs.graphs == captured
    layer = model.get_base_model().model.layers[0].mlp.down_proj
    before = model_fingerprint(module_list(model))
    layer.base_layer.weight = torch.nn.Parameter(layer.base_layer.weight.detach().clone())   # new storage
    assert model_fingerprint(module_list(model)) != before
    result = driver.generate(random_prompts([6, 6]), params)
    assert replay.graphs.graphs and all(replay.graphs.graphs[k] is not captured[k]
                                        for k in replay.graphs.graphs if k in captured)
    assert result[0].token_ids == hf_greedy(model, random_prompts([6, 6])[0], 4)
    width = replay.width
    driver.generate(random_prompts([6]), SamplingParams(max_new_tokens=width * 16))
    assert replay.width > width


def test_adapter_switch_changes_fingerprint():
    model = make_model("llama", lora=True)
    before = model_fingerprint(module_list(model))
    with model.disable_adapter():
        assert model_fingerprint(module_list(model)) != before
    assert model_fingerprint(module_list(model)) == before


def test_a_new_lora_scaling_or_buffer_drops_the_graphs():
    """A graph holds the LoRA scaling as a constant and reads buffers (rotary frequencies) at fixed addresses: a
    rescaled adapter or a buffer given new storage is captured again, and the tokens follow the model."""
    from peft.helpers import rescale_adapter_scale
    model = make_model("llama", lora=True)
    driver = SyncCBDriver(model, CBConfig(max_batch_size=4, block_size=8), static_decode=True)
    prompts, params = random_prompts([6, 9]), SamplingParams(max_new_tokens=4)
    driver.generate(prompts, params)
    graphs = driver.runner.replay.graphs
    captured = dict(graphs.graphs)
    with rescale_adapter_scale(model, 0.0):                # LoRA off: the base model's tokens
        result = driver.generate(prompts, params)
        assert captured and all(graphs.graphs[k] is not captured[k] for k in graphs.graphs if k in captured)
    with model.disable_adapter():
        assert [r.token_ids for r in result] == [hf_greedy(model, p, 4) for p in prompts]
    captured = dict(graphs.graphs)
    rotary = model.get_base_model().model.rotary_emb
    rotary.register_buffer("inv_freq", rotary.inv_freq.clone(), persistent=False)
    driver.generate(prompts, params)
    assert all(graphs.graphs[k] is not captured[k] for k in graphs.graphs if k in captured)


class UncapturedSteps(list):
    """A driver observer: for every step run uncaptured, (its chunks as (length, samples, is a decode row), whether
    it ran through the compiled function)."""

    def __call__(self, step) -> None:
        if step.path != "replay":
            self.append(([(c.length, c.samples, c.start >= len(c.request.prompt)) for c in step.plan],
                         step.path == "compiled"))


def _step_kind(chunks) -> str:
    decode_rows = any(is_decode for _, _, is_decode in chunks)
    if len(chunks) == 1:
        return "one request's chunk" + ("" if chunks[0][1] else " that samples nothing")
    if not decode_rows:
        return "prefill of several requests"
    return "one token a request, with decode rows" if all(n == 1 for n, _, _ in chunks) else "chunks and decode rows"


@pytest.mark.slow
def test_compiled_decode_step_compiles_once_for_all_buckets_drivers_and_prefill_steps():
    """One compile serves every bucket, a second driver with a larger KV cache (same table width), and every step
    that is not pure decode, each through the compiled function: prefill of several requests, one request's
    chunks (sampling nothing, then one row), one-token chunks next to decode rows (as many tokens as requests: the
    decode kernels), longer chunks next to decode rows. Only the decode's sampling mode is captured, and a call
    that never decodes captures nothing."""
    pytest.importorskip("triton")
    from torch._dynamo.utils import counters
    model = make_model("qwen3", lora=True)
    before = counters["stats"]["unique_graphs"]
    kinds = set()
    for lengths, seed, max_batch_tokens, new_tokens in (([3, 20, 41], 0, 2048, 6), ([40, 45, 50], 3, 2048, 6),
                                                         ([37], 4, 16, 6), ([1, 1, 1, 40], 5, 4, 6),
                                                         ([2, 40], 6, 8, 6), ([40], 7, 2048, 1)):
        prompts = random_prompts(lengths, seed=seed)
        steps = UncapturedSteps()
        driver = _compiled_static_path(model, 8, steps, max_batch_tokens=max_batch_tokens)
        results = driver.generate(prompts, SamplingParams(max_new_tokens=new_tokens))
        assert driver.runner.replay.buckets == [2, 4, 8]
        assert [r.token_ids for r in results] == [hf_greedy(model, p, new_tokens) for p in prompts]
        assert steps and all(compiled_step for _, compiled_step in steps)
        samplers = {sampler for _, sampler in driver.runner.replay.graphs.graphs}
        assert samplers == ({SamplerKind.GREEDY} if new_tokens > 1 else set())
        kinds.update(_step_kind(chunks) for chunks, _ in steps)
    assert kinds == {"prefill of several requests", "one request's chunk", "one request's chunk that samples nothing",
                     "one token a request, with decode rows", "chunks and decode rows"}
    assert counters["stats"]["unique_graphs"] - before == 1


@pytest.mark.slow
def test_compiled_bucket_of_one_leaves_the_other_steps_eager():
    """max_batch_size=1 compiles the decode step for one row (its counts of one specialised): steps that are not
    pure decode stay eager rather than compile again."""
    pytest.importorskip("triton")
    from torch._dynamo.utils import counters
    model = make_model("qwen3", lora=True)
    before = counters["stats"]["unique_graphs"]
    steps = UncapturedSteps()
    driver = _compiled_static_path(model, 1, steps, max_batch_tokens=16)
    prompts = random_prompts([37, 5])
    results = driver.generate(prompts, SamplingParams(max_new_tokens=4))
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 4) for p in prompts]
    assert driver.runner.replay.buckets == [1] and driver.runner.replay.forward.active
    assert len(steps) >= 4 and not any(compiled_step for _, compiled_step in steps)
    assert counters["stats"]["unique_graphs"] - before == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "mistral"])
def test_compiled_step_from_embeddings_matches_hf_greedy(name):
    """Compiled, the step starts from embeddings looked up outside the model's forward (Gemma scales them inside
    it; an embedding hook must not break the graph)."""
    pytest.importorskip("triton")
    model = make_model(name)
    model.enable_input_require_grads()
    prompts = random_prompts([3, 20, 41])
    driver = _compiled_static_path(model)
    results = driver.generate(prompts, SamplingParams(max_new_tokens=6))
    assert driver.runner.replay.forward.active and driver.runner.replay.forward.from_embeddings
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 6) for p in prompts]


def test_padded_rows_hold_no_stale_blocks_after_a_smaller_cache():
    model = make_model("llama")
    driver = _driver_with_static_path(model, block_size=4, max_batch_size=8)
    driver.generate(random_prompts([30] * 8), SamplingParams(max_new_tokens=4))
    driver.release()
    prompts = random_prompts([3, 3, 3], seed=5)                 # bucket 4: one padded row
    results = driver.generate(prompts, SamplingParams(max_new_tokens=4))
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 4) for p in prompts]


def test_release_keeping_graphs_replays_them_only_over_a_cache_at_the_same_address():
    """A backend that takes the pools as they are (sdpa_paged here; the batch-invariant one too): kept graphs recorded
    the cache's addresses, so a cache that comes back elsewhere gets new graphs, one that comes back where it was
    replays the kept ones; the tokens are HF's either way."""
    model = make_model("llama")
    driver = _driver_with_static_path(model)
    cache, graphs = driver.cache, driver.runner.replay.graphs
    prompts, params = random_prompts([6, 9]), SamplingParams(max_new_tokens=4)
    driver.generate(prompts, params)
    captured, pools = dict(graphs.graphs), (cache.k_caches, cache.v_caches)
    driver.release(keep_graphs=True)
    assert cache.num_blocks == 0 and not cache.k_caches and graphs.graphs == captured
    results = driver.generate(prompts, params)          # the old pools still held: the new ones lie elsewhere
    assert cache.k_caches[0].data_ptr() != pools[0][0].data_ptr()
    assert captured and all(graphs.graphs[k] is not captured[k] for k in captured)
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 4) for p in prompts]
    captured, pools, blocks = dict(graphs.graphs), (cache.k_caches, cache.v_caches), cache.num_blocks
    driver.release(keep_graphs=True)
    cache.k_caches, cache.v_caches, cache.num_blocks = *pools, blocks    # as if they came back where they were
    results = driver.generate(prompts, params)
    assert graphs.graphs == captured
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 4) for p in prompts]
    driver.release()
    assert not graphs.graphs


@pytest.mark.slow
def test_release_keeping_graphs_follows_moved_pools_on_the_triton_backend():
    """The Triton backend's decode reads the pools through the cache's address table: kept graphs serve pools that
    come back elsewhere (the table rewritten), and the tokens are HF's."""
    pytest.importorskip("triton")
    model = make_model("llama")
    driver = _driver_with_static_path(model, attn_backend="triton", block_size=8)
    cache, graphs = driver.cache, driver.runner.replay.graphs
    prompts, params = random_prompts([6, 9]), SamplingParams(max_new_tokens=4)
    driver.generate(prompts, params)
    captured, pools = dict(graphs.graphs), (cache.k_caches, cache.v_caches)
    driver.release(keep_graphs=True)
    results = driver.generate(prompts, params)          # the old pools still held: the new ones lie elsewhere
    assert cache.k_caches[0].data_ptr() != pools[0][0].data_ptr()
    assert torch.equal(cache.pool_offsets, offsets_to_pools(cache.pool_offsets, cache.k_caches, cache.v_caches))
    assert captured and graphs.graphs == captured
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 4) for p in prompts]


def test_graphs_recaptured_when_the_autocast_state_changes():
    """A graph records the dtypes autocast chose at capture: a call under another autocast state captures anew."""
    model = make_model("llama")
    driver = _driver_with_static_path(model)
    graphs, params = driver.runner.replay.graphs, SamplingParams(max_new_tokens=3)
    driver.generate(random_prompts([6, 6]), params)
    captured = dict(graphs.graphs)
    driver.generate(random_prompts([6, 6]), params)
    assert graphs.graphs == captured
    with torch.autocast("cpu", dtype=torch.bfloat16):
        driver.generate(random_prompts([6, 6]), params)
    assert captured and all(graphs.graphs[k] is not captured[k] for k in captured)


@pytest.mark.slow
def test_a_failing_compile_warns_and_leaves_the_step_uncompiled(monkeypatch):
    model = make_model("qwen3", lora=True)
    driver = _compiled_static_path(model)

    def graph_break(*args):
        raise torch._dynamo.exc.Unsupported("graph break")
    monkeypatch.setattr(compiled, "_compiled_model_logits", lambda: graph_break)
    prompts = random_prompts([5, 9, 14])
    with pytest.warns(RuntimeWarning, match="compile of the decode step failed"):
        results = driver.generate(prompts, SamplingParams(max_new_tokens=4))
    assert not driver.runner.replay.forward.active
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 4) for p in prompts]
    graphs = driver.runner.replay.graphs
    captured = dict(graphs.graphs)
    assert [r.token_ids for r in driver.generate(prompts, SamplingParams(max_new_tokens=4))] == \
        [r.token_ids for r in results]
    assert captured and graphs.graphs == captured           # the uncompiled graphs serve the next call as they are


@pytest.mark.slow
def test_compiled_step_starts_from_ids_when_embeddings_alone_change_the_logits():
    """Models with per-layer token inputs (Gemma-3n) compute more from the ids than the embedding lookup: there
    the compiled step keeps the ids. Stand-in: a model whose forward shifts embeddings given without ids."""
    model = make_model("llama")
    inner_forward = model.model.forward

    def forward(input_ids=None, inputs_embeds=None, **kwargs):
        if input_ids is None:
            inputs_embeds = inputs_embeds + 0.5
        return inner_forward(input_ids=input_ids, inputs_embeds=inputs_embeds, **kwargs)
    model.model.forward = forward
    driver = _compiled_static_path(model)
    prompts = random_prompts([5, 9, 14])
    results = driver.generate(prompts, SamplingParams(max_new_tokens=4))
    assert driver.runner.replay.forward.active and driver.runner.replay.forward.from_embeddings is False
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 4) for p in prompts]


def _cosine_kernel_calls(model, ids) -> int:
    """How many kernel calls of a compiled forward of `model` evaluate a cosine (inductor names a kernel after the
    ops fused into it)."""
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    with torch.no_grad():
        _, code = run_and_get_code(torch.compile(lambda: model(ids).logits))
    lines = [line for source in code for line in source.splitlines()]
    names = {line.split("=")[0].strip() for line in lines if "async_compile." in line and "cos" in line.split("=")[0]}
    return sum(line.strip().startswith(name + "(") or line.strip().startswith(name + ".run(")
               for line in lines for name in names)


@pytest.mark.slow
def test_compiled_forward_computes_the_rotary_tables_once():
    """Inductor would evaluate cos/sin inside each layer's query and key kernels; with the tables materialized
    one kernel computes them. Eager calls return the module's own tables, nesting wraps once, and the forward is
    restored."""
    from cb_sync.model_patching.rotary import rotary_tables_materialized
    model = make_model("qwen3")
    rotary = model.model.rotary_emb
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    assert _cosine_kernel_calls(model, ids) >= model.config.num_hidden_layers
    with rotary_tables_materialized(model.modules()):
        assert _cosine_kernel_calls(model, ids) == 1
        wrapped = rotary.forward
        with rotary_tables_materialized(model.modules()):
            assert rotary.forward is wrapped                # nested: not wrapped twice
        hidden, positions = torch.zeros(1, 5, model.config.hidden_size), torch.arange(5)[None]
        assert all(torch.equal(a, b) for a, b in zip(rotary(hidden, positions),
                                                     type(rotary).forward(rotary, hidden, positions)))
    assert "forward" not in rotary.__dict__
    torch._dynamo.reset()
