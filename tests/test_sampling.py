"""Sampling: HF filter semantics, seed reproducibility, batch invariance, distribution, logprobs."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from cb_sync import CBConfig, SamplingParams, SyncCBDriver
from cb_sync.sampling.sampler import (CANDIDATES, MAX_CANDIDATE_TOP_K, SamplerKind, SamplingBatch, _filter_and_draw,
                                     sample,
                              sample_exactly)

from conftest import make_model, random_prompts


@pytest.fixture(params=["torch", "kernel"])
def draw_path(request, monkeypatch):
    """The draw in torch (the CPU's), or in the Triton kernel that CUDA runs (here through the interpreter)."""
    import cb_sync.sampling.sampler as sampling
    if request.param == "kernel":
        monkeypatch.setattr(sampling, "_kernel_draws", lambda scores: True)
    return request.param


def _batch(rows, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, positions=None, candidates=False):
    """Sampling rows; candidates: the CANDIDATES sampler (else SORTED where filtered, SAMPLE otherwise)."""
    filtered = bool(top_k or top_p < 1 or min_p > 0)
    return SamplingBatch(
        do_sample=torch.ones(rows, dtype=torch.bool), temperature=torch.full((rows,), temperature),
        top_k=torch.full((rows,), top_k), top_p=torch.full((rows,), top_p), min_p=torch.full((rows,), min_p),
        seeds=torch.arange(rows) if seeds is None else seeds,
        positions=torch.zeros(rows, dtype=torch.int64) if positions is None else positions,
        kind=SamplerKind.CANDIDATES if candidates else SamplerKind.SORTED if filtered else SamplerKind.SAMPLE)


def _hf_allowed(logits, temperature, top_k, top_p, min_p):
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return torch.isfinite(scores), scores


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 5, 1.0, 0.0), (0.7, 0, 0.8, 0.0), (1.3, 0, 1.0, 0.3), (0.1, 5, 0.97, 0.5), (1.0, 20, 0.5, 0.05)])
def test_samples_stay_in_hf_allowed_set(temperature, top_k, top_p, min_p):
    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 3
    allowed, _ = _hf_allowed(logits, temperature, top_k, top_p, min_p)
    for step in range(20):
        tokens, _ = sample_exactly(logits, _batch(64, temperature, top_k, top_p, min_p,
                                          positions=torch.full((64,), step)))
        assert allowed[torch.arange(64), tokens].all()
    assert allowed.sum(1).max() > 1      # the filters leave a real choice


def test_empirical_distribution_matches_filtered_softmax():
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    _, scores = _hf_allowed(logits, 0.8, 6, 0.9, 0.05)
    expected = torch.softmax(scores, dim=-1)[0]
    n = 20000
    tokens, _ = sample_exactly(logits.expand(n, -1), _batch(n, 0.8, 6, 0.9, 0.05, seeds=torch.arange(n) * 7919))
    freq = torch.bincount(tokens, minlength=12).float() / n
    assert (freq - expected).abs().max() < 0.015
    assert freq[expected == 0].sum() == 0


def test_logprobs_are_of_temperature_scaled_softmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 30)
    tokens, logprobs = sample_exactly(logits, _batch(8, temperature=0.5, top_k=4))
    expected = torch.log_softmax(logits / 0.5, dim=-1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, expected)


def test_seed_reproducible_and_batch_invariant(draw_path):
    model = make_model("qwen3")
    prompts = random_prompts([9, 20, 4, 33])
    params = SamplingParams(max_new_tokens=16, do_sample=True, temperature=1.5, top_k=40, seed=1234)
    driver = SyncCBDriver(model, CBConfig(max_batch_tokens=24))
    alone = driver.generate([prompts[1]], params)[0].token_ids
    again = driver.generate([prompts[1]], params)[0].token_ids
    mixed = driver.generate(prompts, [SamplingParams(max_new_tokens=16, do_sample=True, temperature=1.5)] * 1
                            + [params] + [SamplingParams(max_new_tokens=10)] * 2)
    assert alone == again == mixed[1].token_ids
    other_seed = driver.generate([prompts[1]], SamplingParams(max_new_tokens=16, do_sample=True,
                                                              temperature=1.5, top_k=40, seed=99))[0]
    assert other_seed.token_ids != alone


def test_unseeded_requests_differ():
    model = make_model("llama")
    prompt = random_prompts([8])[0]
    results = SyncCBDriver(model).generate([prompt] * 4, SamplingParams(max_new_tokens=12, do_sample=True,
                                                                         temperature=2.0))
    assert len({tuple(r.token_ids) for r in results}) > 1


@pytest.mark.parametrize("do_sample", [False, True])
def test_logprobs_match_teacher_forced_forward(do_sample):
    model = make_model("qwen2")
    prompts = random_prompts([5, 18, 40])
    temperature = 0.8 if do_sample else 1.0
    params = SamplingParams(max_new_tokens=12, do_sample=do_sample, temperature=temperature, logprobs=True)
    results = SyncCBDriver(model, CBConfig(block_size=8, max_batch_tokens=20)).generate(prompts, params)
    for prompt, result in zip(prompts, results):
        full = torch.tensor([prompt + result.token_ids])
        with torch.no_grad():
            logits = model(full).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(
            1, torch.tensor(result.token_ids)[:, None])[:, 0]
        assert len(result.logprobs) == len(result.token_ids)
        assert torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-4)


def test_no_logprobs_unless_asked():
    model = make_model("llama")
    result = SyncCBDriver(model).generate(random_prompts([4]), SamplingParams(max_new_tokens=3))[0]
    assert result.logprobs is None


def test_noise_is_strictly_inside_the_unit_interval():
    from cb_sync.sampling.sampler import uniform_noise
    tokens = torch.arange(1 << 18).expand(64, -1)
    u = uniform_noise(torch.full((64,), 12345), torch.arange(64), tokens)
    assert 0 < u.min() and u.max() < 1


def test_vocabulary_hashed_once_draws_the_same_noise(draw_path):
    """Rows over the whole vocabulary take the tokens' hashes from one table (in order, or gathered for sorted rows),
    and the kernel hashes them itself: the noise, and so the draw, equal those of hashing every (row, token) pair."""
    from cb_sync.sampling.sampler import _gumbel_argmax, uniform_noise
    rows, vocab = 5, 1000
    gen = torch.Generator().manual_seed(3)
    seeds = torch.randint(0, 2 ** 62, (rows,), generator=gen)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    batch = SamplingBatch(do_sample=torch.ones(rows, dtype=torch.bool), temperature=torch.ones(rows),
                          top_k=torch.zeros(rows, dtype=torch.int64), top_p=torch.ones(rows), min_p=torch.zeros(rows),
                          seeds=seeds, positions=positions, kind=SamplerKind.SAMPLE)
    scores = torch.randn(rows, vocab, generator=gen)
    in_order = torch.arange(vocab).expand(rows, -1)
    permuted = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(rows)])
    assert torch.equal(uniform_noise(seeds, positions, torch.arange(vocab)[None]),
                       uniform_noise(seeds, positions, in_order))
    for ids, given in ((in_order, None), (permuted, permuted), (permuted[:, :64], permuted[:, :64])):
        noise = uniform_noise(seeds, positions, ids)
        expected = (scores[:, :ids.shape[1]] - torch.log(-torch.log(noise))).argmax(dim=-1)
        assert torch.equal(_gumbel_argmax(scores[:, :ids.shape[1]], batch, given, vocab), expected)


def _check_kernel_draw(device: str, split_columns: int, monkeypatch) -> None:
    """The Triton draw against torch's on fresh random rows on `device`, rows split every `split_columns`."""
    import cb_sync.sampling.sampler as sampling
    from cb_sync.sampling import draw_kernel
    from cb_sync.sampling.draw_kernel import gumbel_argmax
    monkeypatch.setattr(draw_kernel, "SPLIT_COLUMNS", split_columns)
    monkeypatch.setattr(sampling, "_kernel_draws", lambda scores: False)      # torch's draw, the expected one
    seed = int(torch.randint(0, 2 ** 31, ()))
    gen = torch.Generator().manual_seed(seed)
    for rows, columns, with_ids in ((6, 2500, False), (9, 64, True), (4, 1500, True)):
        seeds = torch.randint(-2 ** 62, 2 ** 62, (rows,), generator=gen)
        positions = torch.randint(0, 1 << 20, (rows,), generator=gen)
        scores = torch.randn(rows, columns, generator=gen) * 3
        scores[0, : columns // 2] = float("-inf")
        scores[1] = 0.0                                          # the noise alone decides
        scores[2] = float("-inf")
        scores[3, [columns // 3, columns - 1]] = float("nan")     # torch.argmax: the first NaN
        if rows > 4:
            scores[4, columns - 1] = float("nan")                 # a NaN in the last split only
        ids = torch.stack([torch.randperm(150_000, generator=gen)[:columns] for _ in range(rows)]) if with_ids else None
        scores, seeds, positions = scores.to(device), seeds.to(device), positions.to(device)
        ids = None if ids is None else ids.to(device)
        batch = _batch(rows, seeds=seeds, positions=positions)
        expected = sampling._gumbel_argmax(scores, batch, ids, 150_000 if with_ids else columns)
        assert torch.equal(gumbel_argmax(scores, seeds, positions, ids), expected), f"seed {seed}"
        assert expected[2] == 0 and expected[3] == columns // 3 and (rows <= 4 or expected[4] == columns - 1)
    tied = torch.full((3, 2500), float("-inf"), device=device)
    tied[:, [5, 9, 2000]] = float("inf")                         # +inf plus any noise: a tie, the first column wins
    seeds, positions = torch.arange(3, device=device), torch.zeros(3, dtype=torch.int64, device=device)
    assert gumbel_argmax(tied, seeds, positions, None).tolist() == [5, 5, 5]


@pytest.mark.parametrize("split_columns", [8192, 1024])
def test_kernel_draw_equals_torch_draw(monkeypatch, split_columns):
    """Whole rows in several column blocks, token ids given, rows masked to -inf, NaNs, exact ties (the first column
    wins), negative and 64-bit seeds; each row drawn by one program, or split across programs (1,024 columns each)
    and combined, ties and NaNs in different splits (here through the interpreter)."""
    _check_kernel_draw("cuda" if torch.cuda.is_available() else "cpu", split_columns, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("split_columns", [8192, 1024])
def test_kernel_draw_edge_cases_on_cuda(monkeypatch, split_columns):
    """The same cases compiled for the GPU, where a reduction's ties are not resolved in lane order by chance."""
    _check_kernel_draw("cuda", split_columns, monkeypatch)


@pytest.mark.slow
def test_peaked_logits_never_sample_another_token():
    """With a real vocabulary size, about 1% of rows used to draw u == 1 for some token (an infinite Gumbel)."""
    rows = 512
    logits = torch.zeros(rows, 151936)
    logits[:, 7] = 50.0
    tokens, _ = sample_exactly(logits, _batch(rows, seeds=torch.full((rows,), 12345), positions=torch.arange(rows)))
    assert (tokens == 7).all()
    filtered, _ = sample_exactly(logits[:32], _batch(32, top_k=1, seeds=torch.full((32,), 12345),
                                                     positions=torch.arange(32)))
    assert (filtered == 7).all()


def test_top_k_keeps_ties_like_hf():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]]).expand(4000, -1)
    allowed, _ = _hf_allowed(logits[:1], 1.0, 2, 1.0, 0.0)
    assert allowed[0].tolist() == [True, True, True, False, False]
    tokens, _ = sample_exactly(logits, _batch(4000, top_k=2, seeds=torch.arange(4000)))
    assert set(tokens.tolist()) == {0, 1, 2}


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 5, 1.0, 0.0), (0.1, 5, 0.97, 0.5), (1.0, 20, 0.5, 0.05), (1.3, MAX_CANDIDATE_TOP_K, 0.9, 0.0)])
@pytest.mark.parametrize("bf16_logits", [False, True])
def test_top_k_candidates_give_the_sorted_vocabulary_tokens(temperature, top_k, top_p, min_p, bf16_logits):
    """A candidate row draws exactly what the filters over the whole sorted vocabulary draw (the noise is keyed by
    token id, ties are ordered by id on both paths), also with the many exact ties of bf16 logits."""
    _check_candidates_against_sorted_vocabulary(512, 5000, temperature, top_k, top_p, min_p, bf16_logits)


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(0.1, 5, 0.97, 0.5), (1.3, MAX_CANDIDATE_TOP_K, 0.9, 0.0)])
def test_top_k_candidates_give_the_sorted_vocabulary_tokens_through_the_kernel(temperature, top_k, top_p, min_p,
                                                                               monkeypatch):
    """The same with both draws in the Triton kernel (fewer rows: it runs interpreted here)."""
    import cb_sync.sampling.sampler as sampling
    monkeypatch.setattr(sampling, "_kernel_draws", lambda scores: True)
    _check_candidates_against_sorted_vocabulary(48, 2000, temperature, top_k, top_p, min_p, True)


def _check_candidates_against_sorted_vocabulary(rows, vocab, temperature, top_k, top_p, min_p, bf16_logits):
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab) * 3
    if bf16_logits:
        logits = logits.bfloat16().float()
    for step in range(3):
        batch = _batch(rows, temperature, top_k, top_p, min_p, positions=torch.full((rows,), step),
                       candidates=True)
        fast, _, tied = sample(logits, batch)
        assert not tied.any()
        scaled = logits / temperature
        values, order = scaled.sort(dim=-1, descending=True, stable=True)
        full, _ = _filter_and_draw(values, order, batch, logits.shape[1])
        assert torch.equal(fast, full)
        assert len(set(fast.tolist())) > 1


@pytest.mark.parametrize("sort_vocabulary", [False, True])
def test_candidate_rows_stay_in_hf_allowed_set(sort_vocabulary):
    torch.manual_seed(0)
    logits = (torch.randn(64, 300) * 3).bfloat16().float()
    allowed, _ = _hf_allowed(logits, 0.1, 5, 0.97, 0.5)
    for step in range(10):
        tokens, _ = sample_exactly(logits, _batch(64, 0.1, 5, 0.97, 0.5, positions=torch.full((64,), step),
                                                  candidates=not sort_vocabulary))
        assert allowed[torch.arange(64), tokens].all()


def test_top_k_ties_past_the_candidates_are_flagged_and_sampled_from_the_whole_tie():
    rows, tie = 2000, 3 * CANDIDATES
    logits = torch.randn(rows, 1000)
    logits[:, 100:100 + tie] = 10.0           # HF's top-k with k=5 keeps every token tied with the 5th
    batch = _batch(rows, top_k=5, seeds=torch.arange(rows), candidates=True)
    _, _, tied = sample(logits, batch)
    assert tied.all()
    tokens, _ = sample_exactly(logits, batch)
    allowed, _ = _hf_allowed(logits[:1], 1.0, 5, 1.0, 0.0)
    assert allowed[0, tokens].all()
    assert len(set(tokens.tolist())) > CANDIDATES     # drawn beyond the first CANDIDATES tied tokens


@pytest.mark.slow
def test_a_row_draws_the_same_whatever_path_the_other_rows_need(draw_path):
    """A candidate row next to a row that needs the sorted vocabulary (top_k 0) draws what it draws alone."""
    torch.manual_seed(0)
    logits = (torch.randn(2, 5000) * 3).bfloat16().float()
    alone = _batch(1, 1.0, 20, 0.5, 0.0, seeds=torch.tensor([7]), candidates=True)
    mixed = _batch(2, 1.0, 20, 0.5, 0.0, seeds=torch.tensor([7, 8]))
    mixed.top_k[1] = 0
    for step in range(50):
        alone.positions[:] = step
        mixed.positions[:] = step
        assert sample(logits[:1], alone)[0][0] == sample(logits, mixed)[0][0]


def test_candidate_rows_take_the_candidates_draw_when_the_batch_also_sorts(monkeypatch):
    """Routing: with the sorted vocabulary computed for another row, a candidate row still takes its candidates'
    draw (float sums over 64 or over all columns may round apart on a GPU), a tied or non-candidate row the other."""
    import cb_sync.sampling.sampler as sampling
    real = sampling._filter_and_draw

    def full_path_draws_token_0(values, order, batch, vocab):
        tokens, kept_all = real(values, order, batch, vocab)
        return (tokens * 0 if values.shape[1] == 5000 else tokens), kept_all

    torch.manual_seed(0)
    logits = torch.randn(3, 5000) * 3
    logits[2, 100:100 + 2 * CANDIDATES] = 20.0          # row 2: a top-k tie past the candidates
    alone, _, _ = sample(logits[:1], _batch(1, 1.0, 20, 0.5, candidates=True))
    monkeypatch.setattr(sampling, "_filter_and_draw", full_path_draws_token_0)
    batch = _batch(3, 1.0, 20, 0.5)
    batch.top_k[1] = 0
    tokens, _, tied = sample(logits, batch)
    assert tied is None
    assert tokens.tolist() == [alone[0].item(), 0, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("rows,with_ids", [(4, False), (64, False), (64, True)])
def test_kernel_draw_equals_torch_draw_on_cuda(rows, with_ids, monkeypatch):
    """On CUDA the kernel draws what torch's hash, logs and argmax draw, over the whole 151,936-token vocabulary (or
    64 candidates of it): the same noise bits and CUDA's logf on both sides."""
    import cb_sync.sampling.sampler as sampling
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2 ** 31, ())))
    vocab = 151_936
    columns = CANDIDATES if with_ids else vocab
    scores = torch.randn(rows, columns, device="cuda", generator=gen) * 3
    ids = torch.randperm(vocab, device="cuda", generator=gen)[:columns].expand(rows, -1) if with_ids else None
    batch = _batch(rows, seeds=torch.randint(-2 ** 62, 2 ** 62, (rows,), device="cuda", generator=gen),
                   positions=torch.randint(0, 4096, (rows,), device="cuda", generator=gen))
    batch = SamplingBatch(**{f: getattr(batch, f).cuda() if torch.is_tensor(getattr(batch, f)) else getattr(batch, f)
                             for f in batch.__dataclass_fields__})
    for step in range(5):
        batch.positions += 1
        kernel = sampling._gumbel_argmax(scores, batch, ids, vocab)
        monkeypatch.setattr(sampling, "_kernel_draws", lambda s: False)
        assert torch.equal(kernel, sampling._gumbel_argmax(scores, batch, ids, vocab))
        monkeypatch.undo()


@pytest.mark.gpu
@pytest.mark.parametrize("with_ids", [False, True])
def test_kernel_noise_has_torch_bits_on_cuda(with_ids):
    """Scores equal to torch's log(-log(u)) make every noisy score exactly 0 in torch, so its draw is column 0; the
    kernel draws column 0 only if no column's log(-log(u)) came out below torch's (CUDA's logf on both sides)."""
    from cb_sync.sampling.draw_kernel import gumbel_argmax
    from cb_sync.sampling.sampler import uniform_noise
    rows, vocab = 8, 151_936
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2 ** 31, ())))
    seeds = torch.randint(-2 ** 62, 2 ** 62, (rows,), device="cuda", generator=gen)
    positions = torch.randint(0, 4096, (rows,), device="cuda", generator=gen)
    ids = torch.stack([torch.randperm(vocab, device="cuda", generator=gen) for _ in range(rows)]) if with_ids else None
    scores = torch.log(-torch.log(uniform_noise(seeds, positions, torch.arange(vocab, device="cuda")[None]
                                                if ids is None else ids)))
    assert torch.equal(gumbel_argmax(scores, seeds, positions, ids), torch.zeros(rows, dtype=torch.int64,
                                                                                 device="cuda"))
