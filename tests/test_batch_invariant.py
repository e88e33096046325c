"""CBConfig(batch_invariant=True): a request's tokens and logprobs are bit-identical alone and inside any batch, with
chunked prefill, preemption and graph replay; a trainer's forward gives the generator's logprobs bit for bit."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from benchmarks.throughput import padded_batch
from cb_sync import CBConfig, SamplingParams, SyncCBDriver
from cb_sync.attention import sdpa_paged
from cb_sync.attention.metadata import AttnMetadata
from cb_sync.batch_invariant import attention as invariant
from cb_sync.batch_invariant import ops, trainer
from cb_sync.batch_invariant.ops import ROWS, invariant_ops, suspended
from cb_sync.batch_invariant.logprobs import token_logprobs
from cb_sync.batch_invariant.packing import packed_batch
from cb_sync.batch_invariant.trainer import default_forward, invariant_token_logprobs, invariant_training
from cb_sync.batch_invariant.training_attention import (INVARIANT_IMPLEMENTATION, invariant_attention_forward,
                                                        positions_from_mask, training_pages)
from cb_sync.tuning import KernelTuning, LoraTuning

from conftest import make_model, random_prompts

F = torch.nn.functional


def padded_pages(attention_mask: torch.Tensor, block_size: int):
    """The attention's pages of a left- or right-padded batch [B, T] run unpacked: a sequence a row."""
    rows, length = attention_mask.shape
    sequences = torch.arange(rows)[:, None].expand(rows, length)
    return training_pages(positions_from_mask(attention_mask), sequences, rows, length, block_size)


def test_invariant_ops_give_a_row_the_same_bits_in_any_batch():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3 * ROWS + 9, 96, generator=gen)
    w, b, scale = torch.randn(80, 96, generator=gen), torch.randn(80, generator=gen), torch.randn(96, generator=gen)
    ops = {"linear": lambda t: F.linear(t, w, b), "mean": lambda t: t.pow(2).mean(-1, keepdim=True),
           "mean_3d": lambda t: t.view(t.shape[0], 4, 24).mean(dim=2), "log_softmax": lambda t: t.log_softmax(-1),
           "softmax": lambda t: F.softmax(t, dim=-1), "cumsum": lambda t: torch.cumsum(t, dim=1),
           "layer_norm": lambda t: F.layer_norm(t, (96,), scale), "rms_norm": lambda t: F.rms_norm(t, [96], scale)}
    with invariant_ops():
        for name, op in ops.items():
            full = op(x)
            for start, stop in ((0, 1), (5, 9), (ROWS - 3, ROWS + 40), (17, 3 * ROWS + 9)):
                assert torch.equal(op(x[start:stop]), full[start:stop]), (name, start, stop)
            assert torch.equal(op(x[:0]), full[:0])


def test_suspended_leaves_every_op_as_it_is_on_its_thread_only(monkeypatch):
    """Inside suspended(), invariant_ops() blocks (entered before or inside it) pass ops through; the flag is this
    thread's and is restored after, also on error."""
    calls = []
    monkeypatch.setattr(ops, "linear_rows", lambda *args: calls.append(1) or F.linear(*args))
    rows, weight = torch.randn(3, 8), torch.randn(5, 8)
    elsewhere = []
    with invariant_ops():
        F.linear(rows, weight)
        with suspended():
            F.linear(rows, weight)
            with invariant_ops():
                F.linear(rows, weight)
            thread = threading.Thread(target=lambda: elsewhere.append(getattr(ops._SUSPENDED, "on", False)))
            thread.start()
            thread.join()
        F.linear(rows, weight)
    assert calls == [1, 1] and elsewhere == [False]
    with pytest.raises(RuntimeError, match="inside"), suspended():
        raise RuntimeError("inside")
    assert not getattr(ops._SUSPENDED, "on", False)


def test_default_forward_restores_the_outside_attention_inside_invariant_training():
    """default_forward inside (nested) invariant_training blocks: the model's attention implementation from outside
    them for the block, the invariant one again after (also on error), nothing left behind; outside any block it
    changes nothing. Its forward equals the model's own."""
    model = make_model("qwen3").eval()
    config, outside = model.config, model.config._attn_implementation
    ids = torch.randint(3, 100, (2, 6))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with invariant_training(model, lora_kernels=False), invariant_training(model, lora_kernels=False):
            assert config._attn_implementation == INVARIANT_IMPLEMENTATION
            with default_forward(model):
                assert config._attn_implementation == outside
                assert torch.equal(model(input_ids=ids).logits, expected)
            with pytest.raises(RuntimeError, match="inside"), default_forward(model):
                raise RuntimeError("inside")
            assert config._attn_implementation == INVARIANT_IMPLEMENTATION
        assert config._attn_implementation == outside
        assert trainer._OUTSIDE_ATTENTION == {}
        with default_forward(model):
            assert config._attn_implementation == outside


def _mixed_metadata(cache_shape, lengths, q_lens, gen):
    """A step of requests with context lengths `lengths`, the last q_lens of each queried, blocks shuffled."""
    num_blocks, block_size = cache_shape[:2]
    order = torch.randperm(num_blocks, generator=gen)
    tables, used = torch.zeros(len(lengths), num_blocks, dtype=torch.int32), 0
    for r, n in enumerate(lengths):
        count = -(-n // block_size)
        tables[r, :count] = order[used:used + count]
        used += count
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttnMetadata(torch.full((sum(q_lens),), -1, dtype=torch.int64), tables,
                        torch.tensor(lengths, dtype=torch.int32), starts, max(q_lens), max(lengths), [], [],
                        invariant)


@pytest.mark.parametrize("window, softcap", [(None, None), (20, None), (None, 8.0)])
def test_row_attention_matches_the_reference_and_is_row_invariant(window, softcap):
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(2, 80, 4, 2, 16, generator=gen)
    lengths, q_lens = [70, 1, 33, 130, 5], [1, 1, 12, 1, 5]
    meta = _mixed_metadata(k_cache.shape, lengths, q_lens, gen)
    query = torch.randn(sum(q_lens), 4, 16, generator=gen)
    args = (k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len,
            meta.max_seq_len, 0.25, window, softcap)
    expected = sdpa_paged.paged_attention(query, *args)
    token_req = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(q_lens))
    row = torch.arange(len(query)) - meta.query_start_loc[token_req]
    positions = meta.seq_lens[token_req] - torch.tensor(q_lens)[token_req] + row
    out = invariant.row_attention(query, k_cache, v_cache, meta.block_tables, token_req, positions, 0.25, window,
                                  softcap)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # each row alone (its own table), and the rows in reverse order among padding rows, give the same bits
    tables, one = meta.block_tables[token_req], torch.zeros(1, dtype=torch.long)
    for i in range(len(query)):
        blocks = int(positions[i]) // k_cache.shape[1] + 1               # its own context's blocks only
        alone = invariant.row_attention(query[i:i + 1], k_cache, v_cache, tables[i:i + 1, :blocks], one,
                                        positions[i:i + 1], 0.25, window, softcap)
        assert torch.equal(alone[0], out[i])
    flipped = invariant.row_attention(query.flip(0), k_cache, v_cache, tables.flip(0), torch.arange(len(query)),
                                      positions.flip(0), 0.25, window, softcap)
    assert torch.equal(flipped.flip(0), out)


@pytest.mark.parametrize("window, softcap", [(None, None), (20, None), (None, 8.0)])
def test_row_attention_kernel_matches_plain_torch_and_is_row_invariant(window, softcap):
    """The Triton kernel (CUDA's path; interpreted here) against the plain-torch path, and a row alone against the
    same row among others (a padded row, contexts of 1 to 151 keys, GQA)."""
    pytest.importorskip("triton")
    from cb_sync.batch_invariant import attention_kernel
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = torch.randn(2, 80, 4, 2, 16, generator=gen)
    query = torch.randn(9, 4, 16, generator=gen)
    tables = torch.randperm(80, generator=gen).view(2, 40)          # two sequences' blocks, rows from both
    row_tables = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1, 1])
    positions = torch.tensor([0, 5, 17, 63, 64, 100, 150, -1, 33])
    expected = invariant.row_attention(query, k_cache, v_cache, tables, row_tables, positions, 0.25, window, softcap)
    out = attention_kernel.row_attention(query, k_cache, v_cache, tables, row_tables, positions, 0.25,
                                         invariant.KEYS_PER_BLOCK, window, softcap)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[7], torch.zeros_like(out[7]))
    for i in (0, 5, 6):
        blocks = int(positions[i]) // k_cache.shape[1] + 1
        alone = attention_kernel.row_attention(query[i:i + 1], k_cache, v_cache, tables[row_tables[i:i + 1], :blocks],
                                               torch.zeros(1, dtype=torch.long), positions[i:i + 1], 0.25,
                                               invariant.KEYS_PER_BLOCK, window, softcap)
        assert torch.equal(alone[0], out[i])


def serve_kernels(monkeypatch, means: bool = True):
    """Both sides through the (interpreted) Triton kernels, as on CUDA: attention, LoRA layers, the fused norms, rotary
    and SiLU, and means."""
    pytest.importorskip("triton")
    from cb_sync.batch_invariant import fused_forwards
    from cb_sync.batch_invariant import lora as invariant_lora
    monkeypatch.setattr(invariant, "_kernel_serves", lambda query: True)
    monkeypatch.setattr(fused_forwards, "_kernel_serves", lambda x: True)
    monkeypatch.setattr(invariant_lora, "_invariant_kernel_serves", lambda device: True)
    monkeypatch.setattr(invariant_lora, "large_tiles_agree", lambda tuning, device: True)   # as a GPU's may say
    if means:
        monkeypatch.setattr(ops, "_mean_kernel_serves", lambda x: x.is_floating_point())


def _with_lora(model, targets=("q_proj", "k_proj", "v_proj", "down_proj")):
    """LoRA on a group of three projections and a single one: both kernel paths, at half the interpreter's time."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=list(targets))
    return get_peft_model(model, config).eval()


@pytest.mark.slow
def test_through_the_kernels_a_request_is_bit_identical_alone_and_in_a_batch(monkeypatch):
    """bf16 (the LoRA kernel's single-product path: the interpreter's time) without the row-mean kernel (a program
    per row: tested below and on its own). The LoRA kernel's large tiles from 12 rows on: the prefills take them,
    the decode steps not."""
    serve_kernels(monkeypatch, means=False)
    model = _with_lora(make_model("qwen3")).to(torch.bfloat16)
    target, others = random_prompts([21], seed=4)[0], random_prompts([5, 40, 13], seed=5)
    params = SamplingParams(max_new_tokens=5, do_sample=True, temperature=0.9, seed=3, logprobs=True)
    tuning = KernelTuning(lora=LoraTuning(fixed_large_rows=12, fixed_large_block_m=16, fixed_large_block_n=32))
    alone = SyncCBDriver(model, CBConfig(batch_invariant=True, tuning=tuning)).generate([target], params)[0]
    results = SyncCBDriver(model, CBConfig(batch_invariant=True, max_batch_tokens=16, tuning=tuning),
                           static_decode=True).generate(
        others[:2] + [target] + others[2:], [dataclasses.replace(params, seed=i) for i in range(2)] + [params] * 2)
    assert results[2].token_ids == alone.token_ids and results[2].logprobs == alone.logprobs


@pytest.mark.slow
def test_through_the_kernels_the_trainer_gets_the_generators_logprobs(monkeypatch):
    """A sliding window and LoRA; the trainer's forward with gradients (the LoRA kernel's differentiable op)."""
    serve_kernels(monkeypatch)
    model = _with_lora(make_model("mistral"))
    prompts = random_prompts([5, 19], seed=3)
    params = [SamplingParams(max_new_tokens=4, do_sample=True, temperature=0.7, seed=i, logprobs=True)
              for i in range(2)]
    results = SyncCBDriver(model, CBConfig(batch_invariant=True, max_batch_tokens=16)).generate(prompts, params)
    ids, mask, width, keep = padded_batch(prompts, results)
    model.train()
    logprobs, _ = invariant_token_logprobs(model, ids, mask, keep, 0.7, block_size=16)
    assert logprobs.requires_grad
    assert torch.equal(logprobs, torch.tensor([r.logprobs for r in results], dtype=torch.float32))
    logprobs.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_" in n)
    peft, _ = invariant_token_logprobs(model, ids, mask, keep, 0.7, block_size=16, lora_kernels=False)
    torch.testing.assert_close(peft, logprobs, rtol=1e-4, atol=1e-4)


def _seeded(seed=11, **extra):
    return SamplingParams(max_new_tokens=24, do_sample=True, temperature=0.9, seed=seed, logprobs=True, **extra)


@pytest.mark.parametrize("static_decode", [None, True])
@pytest.mark.parametrize("params", [_seeded(), _seeded(top_p=0.8, top_k=20), SamplingParams(max_new_tokens=24,
                                                                                             logprobs=True)],
                         ids=["sample", "filtered", "greedy"])
def test_a_request_is_bit_identical_alone_and_in_any_batch(static_decode, params):
    """Alone against inside a batch with other samplers, chunked prefill (a token budget of 16), more requests than
    slots, and a cache small enough to preempt: same tokens, same logprobs, bit for bit; eager against replayed
    decode steps (static_decode=True runs the graph path's static buffers, uncaptured on the CPU)."""
    model = make_model("qwen3", lora=True)
    target = random_prompts([37], seed=4)[0]
    alone = SyncCBDriver(model, CBConfig(batch_invariant=True), static_decode=static_decode).generate([target],
                                                                                                       params)[0]
    others = random_prompts([5, 60, 23, 90, 14, 41, 8], seed=5)
    preempted = []
    driver = SyncCBDriver(model, CBConfig(batch_invariant=True, block_size=8, num_blocks=16, max_batch_tokens=16,
                                          max_batch_size=4), static_decode=static_decode,
                          observer=lambda step: preempted.extend(c.request.num_preemptions for c in step.plan))
    mixed = [_seeded(seed=i) for i in range(3)] + [params] + [SamplingParams(max_new_tokens=20, logprobs=True)] * 4
    results = driver.generate(others[:3] + [target] + others[3:], mixed)
    assert max(preempted) > 0
    assert results[3].token_ids == alone.token_ids and results[3].logprobs == alone.logprobs
    other = SyncCBDriver(model, CBConfig(batch_invariant=True, max_batch_tokens=16),
                         static_decode=not static_decode).generate([target], params)[0]
    assert other.token_ids == alone.token_ids and other.logprobs == alone.logprobs


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma2"])
def test_trainer_forward_gives_the_generators_logprobs_bit_for_bit(arch):
    """The sampled completions scored by a packed forward of the padded batch (left-padded prompts, right-padded
    completions, train mode, with gradients): the generator's logprobs exactly, 0 at padding; close to HF's own
    forward of the padded batch; entropies close to HF's."""
    model = make_model(arch, lora=arch == "qwen3")
    prompts = random_prompts([5, 19, 11, 30], seed=3)
    lengths = [12, 7, 12, 9]
    params = [SamplingParams(max_new_tokens=n, do_sample=True, temperature=0.7, seed=i, logprobs=True)
              for i, n in enumerate(lengths)]
    results = SyncCBDriver(model, CBConfig(batch_invariant=True, max_batch_tokens=16)).generate(prompts, params)
    ids, mask, width, keep = padded_batch(prompts, results)
    assert keep == max(lengths)
    model.train()
    logprobs, entropies = invariant_token_logprobs(model, ids, mask, keep, 0.7, block_size=16, entropies=True)
    real = mask[:, width:].bool()
    for i, result in enumerate(results):
        assert torch.equal(logprobs[i, :len(result.logprobs)], torch.tensor(result.logprobs, dtype=torch.float32))
    assert not logprobs[~real].any() and not entropies[~real].any()
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask,
                      position_ids=positions_from_mask(mask).clamp(min=0)).logits[:, -keep - 1:-1].float() / 0.7
    plain_logps = torch.log_softmax(plain, -1)
    torch.testing.assert_close(logprobs[real], plain_logps.gather(-1, ids[:, width:, None])[..., 0][real],
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(entropies[real], -(plain_logps.exp() * plain_logps).sum(-1)[real], rtol=1e-4,
                               atol=1e-4)
    logprobs[real].sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_packed_batch_keeps_the_real_tokens_and_scores_the_completions():
    """Left-padded prompts, right-padded completions, and a row whose completion is empty: the packed row holds the
    real tokens in order at their positions, and the scored tokens are the completions' (each predicted by the
    token before it)."""
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 0], [0, 1, 2, 3, 9, 0, 0], [4, 4, 4, 4, 0, 0, 0]])
    mask = (ids > 0).long()
    packed = packed_batch(ids, mask, 3, 4)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 1, 2, 3, 9, 4, 4, 4, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]]
    assert packed.pages.sequences.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert packed.targets.tolist() == [7, 8, 9] and packed.predicting.tolist() == [1, 2, 6]
    assert packed.scored.tolist() == [0, 1, 3]
    assert packed.unpacked(torch.tensor([1.0, 2.0, 3.0])).tolist() == [[1, 2, 0], [3, 0, 0], [0, 0, 0]]
    nothing = packed_batch(ids[2:], mask[2:], 3, 4)                     # nothing scored: one row computed, dropped
    assert nothing.predicting.numel() == 1 and nothing.scored.numel() == 0
    assert nothing.unpacked(torch.tensor([5.0])).tolist() == [[0, 0, 0]]


def test_packed_forward_equals_the_padded_batchs_bit_for_bit():
    """The same rows scored padded (a row per sequence) and packed (every sequence in one row): the same bits, in a
    left-padded and a right-padded layout, also with a sliding window."""
    for arch in ("qwen3", "mistral"):
        model = make_model(arch)
        ids = torch.tensor(random_prompts([21, 21, 21], seed=8))
        mask = torch.ones_like(ids)
        mask[0, :6], mask[1, 15:] = 0, 0
        packed, _ = invariant_token_logprobs(model, ids, mask, 10, 0.9, block_size=4)
        with invariant_training(model):
            logits = model(input_ids=ids, position_ids=positions_from_mask(mask).clamp(min=0),
                           cb_pages=padded_pages(mask, 4), use_cache=False).logits[:, -11:-1]
        padded, _ = token_logprobs(logits.reshape(-1, logits.shape[-1]), ids[:, -10:].flatten(), 0.9)
        real = (mask[:, -10:] * mask[:, -11:-1]).bool()
        assert torch.equal(packed[real], padded.view(3, 10)[real])


def check_packed_gradients(model, length: int, keep: int, tolerance: float) -> None:
    """The LoRA weights' gradients of sum(logprobs) over the completions' real tokens of four rows of `length`
    (left- and right-padded): from the exact mode's packed forward (gradient checkpointing on: its backward
    recomputes the layers inside the block, as a trainer's step does) close to those of HF's own forward of the
    padded batch, and not all zero."""
    device = next(model.parameters()).device
    ids = torch.tensor(random_prompts([length] * 4, seed=9), device=device)
    mask = torch.ones_like(ids)
    mask[0, :length // 3], mask[1, length - keep + 2:], mask[2, :2] = 0, 0, 0
    real = (mask[:, -keep:] * mask[:, -keep - 1:-1]).bool()
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    model.train()
    model.gradient_checkpointing_enable()
    with invariant_training(model):
        logprobs, _ = invariant_token_logprobs(model, ids, mask, keep, 0.8, block_size=4)
        packed = torch.autograd.grad(logprobs[real].sum(), lora)
    model.gradient_checkpointing_disable()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask).clamp(min=0),
                   use_cache=False).logits[:, -keep - 1:-1].float() / 0.8
    plain = torch.autograd.grad(torch.log_softmax(logits, -1).gather(-1, ids[:, -keep:, None])[..., 0][real].sum(),
                                lora)
    model.eval()
    for got, want in zip(packed, plain):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance / 10)
    assert sum(g.abs().sum() for g in packed) > 0


def test_packed_forwards_gradients_are_the_default_forwards():
    """The exact mode's gradients (packed rows, the attention's backward per sequence, the chunked logprobs'
    backward, recomputed through gradient checkpointing) close to HF's padded forward's."""
    check_packed_gradients(make_model("qwen3", lora=True), 24, 8, 1e-4)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_token_logprobs_and_entropies_and_their_gradients_are_autograds(monkeypatch, entropy_grad):
    """Over several chunks of rows: values and gradients (of the logprobs and, with entropy_grad, the entropies)
    those of plain autograd; without entropy_grad the entropies carry none."""
    from cb_sync.batch_invariant import logprobs as chunked
    monkeypatch.setattr(chunked, "CHUNK_ROWS", 4)
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(11, 70, generator=gen, requires_grad=True)
    tokens = torch.randint(0, 70, (11,), generator=gen)
    weights, entropy_weights = torch.randn(11, generator=gen), torch.randn(11, generator=gen)
    logps, entropies = token_logprobs(logits, tokens, 0.7, entropies=True, entropy_grad=entropy_grad)
    assert entropies.requires_grad == entropy_grad
    ((logps * weights).sum() + ((entropies * entropy_weights).sum() if entropy_grad else 0)).backward()
    reference = logits.detach().clone().requires_grad_()
    log_probs = torch.log_softmax(reference / 0.7, dim=-1)
    want_logps, want_entropies = log_probs.gather(-1, tokens[:, None])[:, 0], -(log_probs.exp() * log_probs).sum(-1)
    ((want_logps * weights).sum() + ((want_entropies * entropy_weights).sum() if entropy_grad else 0)).backward()
    torch.testing.assert_close(logits.grad, reference.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logps, want_logps, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropies, want_entropies, rtol=1e-5, atol=1e-6)
    assert token_logprobs(logits, tokens, 0.7)[1] is None


def test_training_attention_matches_sdpa_forward_and_backward():
    """Against torch's SDPA with the same mask (an independent reference), a padded batch (left- and right-padded
    rows) and the same sequences packed into one row: outputs close, gradients close; padding gets none."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, 10, 8, generator=gen, requires_grad=True) for h in (4, 2, 2))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 7 + [0] * 3])
    positions = positions_from_mask(mask)
    out, _ = invariant_attention_forward(None, q, k, v, None, 0.3, cb_pages=padded_pages(mask, 4))
    allowed = (positions[:, None, None, :] <= positions[:, None, :, None]) & (positions[:, None, None, :] >= 0)
    allowed |= (positions < 0)[:, None, :, None]                  # padded queries: any keys (their rows are dropped)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              attn_mask=allowed, scale=0.3).transpose(1, 2)
    real = positions >= 0
    torch.testing.assert_close(out[real], expected[real], rtol=1e-5, atol=1e-6)
    grad = torch.randn(out.shape, generator=gen) * real[..., None, None]
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for got, wanted in zip(torch.autograd.grad(out, (q, k, v), grad), want):
        torch.testing.assert_close(got, wanted, rtol=1e-5, atol=1e-6)
        assert not got.transpose(1, 2)[~real].any()
    flat = real.flatten()
    packed_q, packed_k, packed_v = (t.detach().transpose(1, 2).reshape(20, -1, 8)[flat].transpose(0, 1)[None]
                                    .requires_grad_() for t in (q, k, v))
    packed = packed_batch(torch.ones_like(mask), mask, 1, 4)
    out, _ = invariant_attention_forward(None, packed_q, packed_k, packed_v, None, 0.3, cb_pages=packed.pages)
    torch.testing.assert_close(out[0], expected[real], rtol=1e-5, atol=1e-6)
    for got, wanted in zip(torch.autograd.grad(out, (packed_q, packed_k, packed_v), grad[real][None]), want):
        torch.testing.assert_close(got[0].transpose(0, 1), wanted.transpose(1, 2)[real], rtol=1e-5, atol=1e-6)


def test_trainer_pages_hold_one_table_per_sequence():
    """The trainer's sequences in pages: a table per sequence and each token's sequence, not a table per token (which
    would take B x T x pages entries a layer: 256 MiB at 8 x 8,192 tokens)."""
    from cb_sync.batch_invariant.training_attention import _paged
    key = torch.randn(3, 40, 2, 16)
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, :7] = 0                                                    # a left-padded row
    pages = padded_pages(mask, 16)
    k_pages = _paged(key.flatten(0, 1), pages)
    assert pages.tables.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] and k_pages.shape == (9, 16, 2, 16)
    assert pages.sequences.tolist() == [0] * 40 + [1] * 40 + [2] * 40
    assert torch.equal(k_pages[3, 0], key[1, 7]) and torch.equal(k_pages[6, 0], key[2, 0])


def test_attention_stays_fp32_under_autocast():
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(2, 8, 4, 2, 16, generator=gen)
    query, tables, positions = torch.randn(3, 4, 16, generator=gen), torch.arange(8)[None], torch.tensor([5, 17, 30])
    rows = torch.zeros(3, dtype=torch.long)
    plain = invariant.row_attention(query, k_cache, v_cache, tables, rows, positions, 0.25)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = invariant.row_attention(query, k_cache, v_cache, tables, rows, positions, 0.25)
    assert torch.equal(plain, autocast)


def test_trainer_forward_of_a_ddp_wrapped_model(tmp_path):
    """A trainer hands its DDP-wrapped model: the forward unwraps it for its settings and calls the wrapper."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        model = make_model("llama")
        ids = torch.tensor(random_prompts([12, 12], seed=6))
        mask = torch.ones_like(ids)
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        torch.testing.assert_close(invariant_token_logprobs(wrapped, ids, mask, 4, 1.0, 16),
                                   invariant_token_logprobs(model, ids, mask, 4, 1.0, 16), rtol=0, atol=0)
        assert model.config._attn_implementation == "sdpa"
    finally:
        dist.destroy_process_group()


def test_batch_invariant_refuses_layers_it_does_not_cover():
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(ValueError, match="Conv1D"):
        SyncCBDriver(gpt2, CBConfig(batch_invariant=True))


def test_batch_invariant_refuses_compile_and_other_backends():
    with pytest.raises(ValueError, match="batch_invariant=True"):
        CBConfig(batch_invariant=True, compile=True)
    with pytest.raises(ValueError, match="attn_backend='auto'"):
        CBConfig(batch_invariant=True, attn_backend="triton")
