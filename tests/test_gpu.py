"""GPU checks (run on the H200): graph replay is bit-exact, driver agrees with HF, invalidation, release."""

from __future__ import annotations

import re
import warnings
from collections import Counter

import pytest
import torch

from cb_sync import CBConfig, SamplingParams, SyncCBDriver
from cb_sync.lora import lora_kernels
from cb_sync.model_patching.generation_mode import generation_mode
from cb_sync.sampling.sampler import SamplerKind
from cb_sync.scheduler import FIFOScheduler

from conftest import StepLog, make_model, random_prompts

pytestmark = pytest.mark.gpu


def _cuda_model(arch="qwen3", lora=True, dtype=torch.float32):
    return make_model(arch, lora=lora).to("cuda", dtype)


def _hf_greedy_cuda(model, prompt, n):
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, min_new_tokens=3,
                 suppress_tokens=[3, 4], eos_token_id=[1, 2])


@pytest.mark.parametrize("penalties", [{}, PENALTIES], ids=["plain", "penalised"])
@pytest.mark.parametrize("kind", [SamplerKind.GREEDY, SamplerKind.CANDIDATES, SamplerKind.SORTED])
def test_replay_is_bit_identical_to_uncaptured_step(kind, penalties):
    """A replayed graph gives the tokens and logprobs of its step run uncaptured, bit for bit; with penalties, the
    token history written and read inside the captured step."""
    model = _cuda_model(dtype=torch.bfloat16)
    driver = SyncCBDriver(model, CBConfig(max_batch_size=8))
    top_k = 100 if kind is SamplerKind.SORTED else 5     # at or above CANDIDATES: the sorted-vocabulary sampler
    sampled = kind is not SamplerKind.GREEDY
    driver.generate(random_prompts([20] * 8), SamplingParams(max_new_tokens=4, do_sample=sampled, top_k=top_k,
                                                             **penalties))
    replay = driver.runner.replay
    inputs = replay.buffers.views
    key = replay.graph_key(8, kind)
    assert key in replay.graphs and len(key) == (3 if penalties else 2)
    with generation_mode(model), lora_kernels(model):      # as inside generate(): same LoRA path both times
        gen = torch.Generator(device="cuda").manual_seed(0)
        inputs["input_ids"].random_(0, 128, generator=gen)
        inputs["positions"][:8] = torch.arange(8, device="cuda") + 10
        inputs["seq_lens"][:8] = inputs["positions"][:8].int() + 1
        inputs["tables"][:8] = (torch.arange(8 * replay.width, device="cuda").view(8, -1).int()
                                % driver.cache.num_blocks)
        inputs["slots"][:8] = -1                     # keep the cache as is: both runs read the same K/V
        inputs["sampling.do_sample"][:8] = sampled
        inputs["sampling.seeds"][:8] = torch.arange(8, device="cuda")
        inputs["sampling.top_k"][:8] = 5
        if penalties:       # prompts of 6 tokens: the history holds the prompt and 5 to 12 outputs
            inputs["sampling.positions"][:8] = inputs["seq_lens"][:8] - 6
            inputs["penalty.prompt_lens"][:8] = 6
            inputs["penalty.table_rows"][:8] = torch.arange(8, device="cuda")
        replay.decode_step(8, kind)
        eager = replay.out_tokens[:8].clone(), replay.out_logprobs[:8].clone()
        replay.out_tokens.zero_()
        replay.graphs.replay(key)
        torch.cuda.synchronize()
    assert torch.equal(replay.out_tokens[:8], eager[0])
    assert torch.equal(replay.out_logprobs[:8], eager[1])


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "gemma2"])
def test_driver_with_graphs_matches_hf_greedy_fp32(arch):
    model = _cuda_model(arch)
    prompts = random_prompts([3, 17, 40, 64, 9, 120])
    params = SamplingParams(max_new_tokens=24)
    driver = SyncCBDriver(model, CBConfig(max_batch_size=8, max_batch_tokens=64))
    results = driver.generate(prompts, params)
    assert driver.runner.replay.graphs.graphs, "pure-decode steps should have replayed graphs"
    for prompt, result in zip(prompts, results):
        assert result.token_ids == _hf_greedy_cuda(model, prompt, 24)


@pytest.mark.parametrize("sampler", [{}, {"do_sample": True}, {"do_sample": True, "top_k": 5},
                                     {"do_sample": True, "top_k": 5, **PENALTIES}])
def test_steps_launched_ahead_equal_steps_run_one_by_one(sampler, monkeypatch):
    """Decode steps queued before the previous step's tokens are read (the input ids taken on the GPU, host
    buffers in turn) give the tokens and logprobs of steps run one at a time, with requests ending on stop tokens
    and others waiting for a place in the batch; greedy, sampling, the candidates' sampler, and with penalties (the
    token a step takes on the GPU is the one its penalties count)."""
    model = _cuda_model()
    prompts = random_prompts([5, 12, 30, 7, 19, 3, 40, 9])
    config = CBConfig(max_batch_size=4, block_size=16)
    free = SyncCBDriver(model, config).generate(prompts, SamplingParams(max_new_tokens=60, seed=0, **sampler))
    stops = [t for t, _ in Counter(t for r in free for t in r.token_ids[2:]).most_common(2)]
    params = [SamplingParams(max_new_tokens=n, seed=i, logprobs=True, stop_token_ids=stops, **sampler)
              for i, n in enumerate((60, 9, 60, 4, 60, 17, 33, 60))]
    steps = StepLog()
    ahead = SyncCBDriver(model, config, observer=steps).generate(prompts, params)
    launches = [step.ahead for step in steps if step.path == "replay"]
    assert sum(launches) >= 5 and not all(launches)
    monkeypatch.setattr(FIFOScheduler, "plan_ahead", lambda self, plan: None)
    one_by_one = SyncCBDriver(model, config).generate(prompts, params)
    assert [r.token_ids for r in ahead] == [r.token_ids for r in one_by_one]
    assert any(r.finish_reason == "stop" for r in ahead)
    for a, b in zip(ahead, one_by_one):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


def test_optimizer_step_seen_without_recapture_and_swap_recaptures():
    model = _cuda_model()
    driver = SyncCBDriver(model, CBConfig(max_batch_size=4))
    prompts = random_prompts([12, 30])
    params = SamplingParams(max_new_tokens=16)
    driver.generate(prompts, params)
    graphs = driver.runner.replay.graphs
    captured = dict(graphs.graphs)
    model.train()
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    optimizer = torch.optim.SGD(lora, lr=5.0)
    ids = torch.tensor([prompts[1]], device="cuda")
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    model.eval()
    after = driver.generate(prompts, params)
    assert graphs.graphs == captured
    assert [r.token_ids for r in after] == [_hf_greedy_cuda(model, p, 16) for p in prompts]
    layer = model.get_base_model().model.layers[1].self_attn.o_proj.base_layer
    layer.weight = torch.nn.Parameter(layer.weight.detach() * 3)
    swapped = driver.generate(prompts, params)
    assert all(graphs.graphs[k] is not captured[k] for k in captured if k in graphs.graphs)
    assert [r.token_ids for r in swapped] == [_hf_greedy_cuda(model, p, 16) for p in prompts]


def test_release_then_generate_same_tokens():
    model = _cuda_model(dtype=torch.bfloat16)
    driver = SyncCBDriver(model, CBConfig(max_batch_size=16))
    prompts = random_prompts([30] * 12)
    params = SamplingParams(max_new_tokens=20, do_sample=True, temperature=0.7, top_p=0.9, seed=7)
    first = driver.generate(prompts, params)
    driver.release()
    assert driver.cache.num_blocks == 0 and not driver.runner.replay.graphs.graphs
    second = driver.generate(prompts, params)
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    captured = dict(driver.runner.replay.graphs.graphs)
    addresses = [t.data_ptr() for t in (*driver.cache.k_caches, *driver.cache.v_caches)]
    driver.release(keep_graphs=True)
    third = driver.generate(prompts, params)          # nothing allocated between: the pools return where they were
    assert [t.data_ptr() for t in (*driver.cache.k_caches, *driver.cache.v_caches)] == addresses
    assert driver.runner.replay.graphs.graphs == captured
    assert [r.token_ids for r in third] == [r.token_ids for r in first]
    held = driver.cache.k_caches, driver.cache.v_caches
    driver.release(keep_graphs=True)
    fourth = driver.generate(prompts, params)         # the old pools held: the new ones lie elsewhere, graphs kept
    assert driver.cache.k_caches[0].data_ptr() != held[0][0].data_ptr()
    assert driver.runner.replay.graphs.graphs == captured
    assert [r.token_ids for r in fourth] == [r.token_ids for r in first]


def test_a_card_with_less_free_memory_than_the_call_needs_preempts_instead_of_running_out(caplog):
    """The card's memory filled but for ~96 MiB beside the step's headroom: the cache takes what is free, the call
    (~320 MiB of KV at once) preempts and recomputes, and its greedy tokens are a roomy call's."""
    import logging
    from transformers import AutoModelForCausalLM, Qwen3Config
    from cb_sync.cache.sizing import device_room, step_headroom
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=256, max_position_embeddings=1024,
                         initializer_range=0.2)                  # 32 KiB of fp32 KV a token
    model = AutoModelForCausalLM.from_config(config).eval().to("cuda")
    prompts, params = random_prompts([24] * 16), SamplingParams(max_new_tokens=600)
    cb_config = CBConfig(max_batch_size=16, max_cache_gib=64)
    roomy = SyncCBDriver(model, cb_config).generate(prompts, params)
    torch.cuda.empty_cache()
    driver = SyncCBDriver(model, cb_config)
    headroom = step_headroom(config, cb_config.max_batch_tokens, cb_config.max_batch_size, model.dtype.itemsize)
    left = 96 * 2**20
    filler = torch.empty(device_room(driver.device, driver.cache.nbytes, headroom) - left, dtype=torch.uint8,
                         device="cuda")
    try:
        with caplog.at_level(logging.WARNING, logger="cb_sync.engine.driver"):
            results = driver.generate(prompts, params)
    finally:
        del filler
        torch.cuda.empty_cache()
    message = caplog.records[0].getMessage()
    assert re.match(r"[1-9]\d* preemptions: ", message) and "(the GPU's free memory, " in message, message
    assert 0.5 * left < driver.cache.nbytes <= 1.1 * left
    assert [r.token_ids for r in results] == [r.token_ids for r in roomy]


@pytest.fixture(scope="module")
def four_b_greedy_run():
    """The Qwen3-4B shape (bf16, LoRA), 32 requests x 128 greedy tokens with logprobs: (model, prompts, results)."""
    from benchmarks.harness import build_model
    model = build_model(lora=True)
    prompts = torch.randint(0, 151936, (32, 128), generator=torch.Generator().manual_seed(0)).tolist()
    results = SyncCBDriver(model, CBConfig(max_batch_size=32, max_batch_tokens=4096)).generate(
        prompts, SamplingParams(max_new_tokens=128, logprobs=True))
    return model, prompts, results


def _teacher_forced(model, prompts, results) -> tuple[torch.Tensor, int]:
    """Log-probabilities of the driver's tokens [requests, tokens] from one forward of `model` over each prompt +
    completion, and how many of those tokens sit more than 0.05 in logit below that forward's argmax."""
    logprobs, off_argmax = [], 0
    with torch.no_grad():
        for prompt, result in zip(prompts, results):
            ids = torch.tensor([prompt + result.token_ids], device="cuda")
            tokens = torch.tensor(result.token_ids, device="cuda")[:, None]
            logits = model(ids).logits[0, len(prompt) - 1:-1].float()
            logprobs.append(torch.log_softmax(logits, -1).gather(1, tokens)[:, 0])
            off_argmax += int((logits.max(-1).values - logits.gather(1, tokens)[:, 0] > 0.05).sum())
    return torch.stack(logprobs), off_argmax


def _driver_logprobs(results) -> torch.Tensor:
    return torch.tensor([r.logprobs for r in results], device="cuda")


@pytest.mark.xfail(strict=True, reason="H200, bf16: mean |delta| 0.031 against the 0.01 target; HF's own bf16 "
                   "forwards differ from each other as much")
def test_4b_shape_logprobs_agree_with_teacher_forced_hf(four_b_greedy_run):
    """32 requests x 128 greedy tokens on the Qwen3-4B shape (bf16, LoRA): driver logprobs vs an HF forward."""
    model, prompts, results = four_b_greedy_run
    reference, off_argmax = _teacher_forced(model, prompts, results)
    delta = (_driver_logprobs(results) - reference).abs()
    print(f"4B logprob |delta|: mean {delta.mean():.5f} max {delta.max():.5f}; "
          f"tokens > 0.05 below HF argmax: {off_argmax}/{delta.numel()}")
    assert delta.mean() <= 0.01


def test_4b_shape_logprobs_as_close_to_fp32_as_hf_bf16_forward(four_b_greedy_run):
    """Against a teacher-forced forward of an fp32 copy of the model, the driver's bf16 logprobs are as close as
    HF's own teacher-forced bf16 forward of the same sequences (within 10%: both measured 0.0350 on the H200)."""
    import copy
    model, prompts, results = four_b_greedy_run
    hf_bf16, _ = _teacher_forced(model, prompts, results)
    fp32 = copy.deepcopy(model).float()
    reference, _ = _teacher_forced(fp32, prompts, results)
    del fp32
    driver = (_driver_logprobs(results) - reference).abs().mean()
    hf = (hf_bf16 - reference).abs().mean()
    print(f"4B logprob mean |delta| against fp32: driver {driver:.5f}, HF bf16 forward {hf:.5f}")
    assert driver <= 1.1 * hf


def test_compiled_step_with_a_hooked_embedding_layer():
    """TRL's GRPO trainer calls `enable_input_require_grads` (a forward hook calling `requires_grad_`, which
    breaks a compiled graph): the embedding lookup stays outside the compiled step, so the step still compiles
    once for every bucket and decodes as HF does."""
    model = _cuda_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.train()
    prompts = random_prompts([5, 9, 14, 30])
    driver = SyncCBDriver(model, CBConfig(max_batch_size=4, compile=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)          # a compile that fell back would warn
        results = driver.generate(prompts, SamplingParams(max_new_tokens=8))
    replay = driver.runner.replay
    assert replay.graphs.graphs and replay.forward.active and replay.forward.from_embeddings
    model.eval()
    assert [r.token_ids for r in results] == [_hf_greedy_cuda(model, p, 8) for p in prompts]


def test_compiled_prefill_and_mixed_steps_share_the_decode_compile():
    """Chunked prefill, mixed prefill + decode steps and a waiting queue run through the compiled decode step:
    one compile for all of them, and greedy tokens as HF's (fp32)."""
    from torch._dynamo.utils import counters
    model = _cuda_model()
    prompts = random_prompts([5, 9, 14, 30, 77, 3])
    log = StepLog()
    driver = SyncCBDriver(model, CBConfig(max_batch_size=4, max_batch_tokens=32, compile=True), observer=log)
    before = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)          # a compile that fell back would warn
        results = driver.generate(prompts, SamplingParams(max_new_tokens=8))
    assert counters["stats"]["unique_graphs"] - before == 1
    uncaptured = [step for step in log if step.path != "replay"]
    steps = [[chunk.length for chunk in step.plan] for step in uncaptured]
    assert any(1 in lengths and max(lengths) > 1 for lengths in steps)      # a step mixing decode and prefill
    assert len(steps) >= 5 and all(step.path == "compiled" for step in uncaptured)
    assert [r.token_ids for r in results] == [_hf_greedy_cuda(model, p, 8) for p in prompts]


def test_batch_invariant_mode_on_the_4b_shape():
    """Qwen3-4B shape + LoRA r32, bf16, CBConfig(batch_invariant=True): a seeded request gives the same tokens and
    logprobs alone and inside a batch of 31 others (chunked prefill, replayed decode graphs), bit for bit, and a
    train-mode full-sequence forward of the batch (left-padded) gives the generator's logprobs bit for bit."""
    from benchmarks.throughput import padded_batch
    from benchmarks.harness import build_model
    from cb_sync.batch_invariant.trainer import invariant_token_logprobs

    model = build_model(lora=True)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150000, (int(n),), generator=gen).tolist()
               for n in torch.randint(20, 120, (32,), generator=gen)]
    params = [SamplingParams(max_new_tokens=48, do_sample=True, temperature=1.0, seed=i, logprobs=True)
              for i in range(32)]
    config = CBConfig(batch_invariant=True, max_batch_tokens=512, max_batch_size=32)
    batch = SyncCBDriver(model, config).generate(prompts, params)
    alone = SyncCBDriver(model, CBConfig(batch_invariant=True)).generate([prompts[5]], params[5])[0]
    assert alone.token_ids == batch[5].token_ids and alone.logprobs == batch[5].logprobs
    ids, mask, _, _ = padded_batch(prompts, batch)
    model.train()
    with torch.no_grad():
        logprobs = invariant_token_logprobs(model, ids.cuda(), mask.cuda(), 48, 1.0, config.block_size)[0].cpu()
    model.eval()
    assert torch.equal(logprobs, torch.tensor([r.logprobs for r in batch], dtype=torch.float32))
    # as the GRPO trainer runs it: rollout and loss forward under bf16 autocast, the loss's with gradients (the LoRA
    # kernel's differentiable op), 8 requests against one alone
    with torch.autocast("cuda", dtype=torch.bfloat16):
        batch = SyncCBDriver(model, config).generate(prompts[:8], params[:8])
        alone = SyncCBDriver(model, CBConfig(batch_invariant=True)).generate([prompts[5]], params[5])[0]
        assert alone.token_ids == batch[5].token_ids and alone.logprobs == batch[5].logprobs
        ids, mask, _, _ = padded_batch(prompts[:8], batch)
        model.train()
        logprobs, _ = invariant_token_logprobs(model, ids.cuda(), mask.cuda(), 48, 1.0, config.block_size)
    model.eval()
    assert logprobs.requires_grad
    assert torch.equal(logprobs.detach().cpu(), torch.tensor([r.logprobs for r in batch], dtype=torch.float32))
    logprobs.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


@pytest.fixture(scope="module")
def small_grpo_model():
    """The Qwen3-1.7B shape (bf16, LoRA r32, its full vocabulary): small enough that the sampler's share of a step
    is large."""
    from benchmarks.harness import build_model
    return build_model(lora=True, shape="qwen3-1.7b")


def test_exact_modes_packed_gradients_on_the_gpu():
    """The exact mode's packed training forward through its CUDA kernels (the LoRA kernel's differentiable op, the
    row attention, the fused kernels) and its backward (SDPA's causal kernels per sequence, the chunked logprobs):
    LoRA gradients close to HF's padded forward's, fp32."""
    from test_batch_invariant import check_packed_gradients
    check_packed_gradients(_cuda_model(), 40, 12, 1e-3)


@pytest.mark.parametrize("batch", [4, 64])
def test_step_time_with_and_without_a_repetition_penalty(small_grpo_model, batch):
    """The GRPO sampler's decode step (workload G's filters: temperature 0.1, top-k 5, top-p 0.97, min-p 0.5) over
    prompts of 256 tokens and 768 new ones, with and without repetition_penalty=1.05: the replayed step's GPU time
    (its last step replayed 100 times: the penalty reads a history of 1024 positions a row) and the call's decode
    steps, launch to launch. Printed for the cost line of docs/benchmarks.md (run with -s); nothing asserted on time,
    only that the penalised call replayed its own graphs."""
    prompts = torch.randint(0, 151936, (batch, 256), generator=torch.Generator().manual_seed(0)).tolist()
    grpo = dict(max_new_tokens=768, do_sample=True, temperature=0.1, top_p=0.97, min_p=0.5, top_k=5)
    lines = []
    for penalty in (1.0, 1.05):
        log = StepLog()
        driver = SyncCBDriver(small_grpo_model, CBConfig(max_batch_size=batch), observer=log)
        driver.generate(prompts, SamplingParams(**grpo, repetition_penalty=penalty), seed=0)
        decode = [step for step in log if step.path == "replay"][10:]
        in_call = (decode[-1].started_at - decode[0].started_at) / (len(decode) - 1)
        replay = driver.runner.replay
        key = replay.graph_key(batch, decode[-1].kind)
        assert key in replay.graphs and len(key) == (2 if penalty == 1.0 else 3)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(100):
            replay.graphs.replay(key)
        end.record()
        end.synchronize()
        lines.append(f"batch {batch}, repetition_penalty {penalty}: replayed step {start.elapsed_time(end) / 100:.3f} "
                     f"ms (GPU), decode step in the call {in_call * 1e3:.3f} ms ({torch.cuda.get_device_name()})")
        driver.release()
    print("\n" + "\n".join(lines))
