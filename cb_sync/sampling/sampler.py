"""GPU sampling: penalties (`penalties`), greedy, temperature, top-k, top-p, min-p (HF order and semantics),
counter-based noise, logprobs.

The noise for request r at output position t and token v is a hash of (r's seed, t, v): it does not depend on what else
is in the batch, and no generator state is carried between steps."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

import torch

from .penalties import PenaltyBatch, apply_penalties

_MASK32 = 0xFFFFFFFF
CANDIDATES = 64       # a row with 0 < top_k <= MAX_CANDIDATE_TOP_K filters the top CANDIDATES tokens only
MAX_CANDIDATE_TOP_K = 32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 32-bit x without overflowing int64."""
    lo = (x & 0xFFFF) * c
    hi = ((x >> 16) * c) & 0xFFFF
    return (lo + (hi << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniform float32 noise strictly inside (0, 1) per (seed [S], position [S], token id [S, V] or [1, V]); depends
    on nothing else. 23 bits keep (k + 0.5) / 2**23 exact in float32, so 1.0 (an infinite Gumbel) never occurs."""
    return _noise(seeds, positions, _token_hash(token_ids))


def _token_hash(token_ids: torch.Tensor) -> torch.Tensor:
    return _mix32(token_ids ^ 0x9E3779B9)


def _noise(seeds: torch.Tensor, positions: torch.Tensor, token_hashes: torch.Tensor) -> torch.Tensor:
    """uniform_noise from the tokens' hashes (_token_hash)."""
    key = _mix32((seeds & _MASK32) ^ _mix32(((seeds >> 32) & _MASK32) ^ _mix32(positions & _MASK32)))
    bits = _mix32(key[:, None] ^ token_hashes)
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


class SamplerKind(Enum):
    """The sampler of a step, the cheapest that serves every row (`sampler_kind`)."""

    GREEDY = "greedy"
    SAMPLE = "sample"            # unfiltered draws
    CANDIDATES = "candidates"    # filters over the top CANDIDATES tokens: every sampling row has a small top_k
    SORTED = "sorted"            # filters over the sorted vocabulary


def candidate_top_k(top_k):
    """Whether filters with top_k (int or tensor) run on the top CANDIDATES tokens: 0 < top_k <= MAX_CANDIDATE_TOP_K
    (the rest of the vocabulary cannot pass it unless tied with the k-th value, which sample() detects)."""
    return (top_k > 0) & (top_k <= MAX_CANDIDATE_TOP_K)


def sampler_kind(params) -> SamplerKind:
    """The cheapest sampler for rows with these SamplingParams."""
    sampled = [p for p in params if p.do_sample]
    if not sampled:
        return SamplerKind.GREEDY
    if not any(p.filtered for p in sampled):
        return SamplerKind.SAMPLE
    return SamplerKind.CANDIDATES if all(candidate_top_k(p.top_k) for p in sampled) else SamplerKind.SORTED


@dataclass
class SamplingBatch:
    """Per-row sampling parameters for the S rows that sample this step (tensors on the logits' device)."""

    do_sample: torch.Tensor     # bool [S]
    temperature: torch.Tensor   # float32 [S], 1 for greedy rows
    top_k: torch.Tensor         # int64 [S], 0 = off
    top_p: torch.Tensor         # float32 [S]
    min_p: torch.Tensor         # float32 [S]
    seeds: torch.Tensor         # int64 [S]
    positions: torch.Tensor     # int64 [S], index of the token being sampled among the request's outputs
    kind: SamplerKind
    penalties: PenaltyBatch | None = None     # None: the call's requests use no penalty


SAMPLING_COLUMNS = {"do_sample": torch.bool, "temperature": torch.float32, "top_k": torch.int64,
                    "top_p": torch.float32, "min_p": torch.float32, "seeds": torch.int64, "positions": torch.int64}


def sampling_columns(requests, positions: list[int]) -> dict[str, list]:
    """Host-side SamplingBatch columns of requests sampling their outputs at `positions` (greedy: temperature 1)."""
    params = [r.params for r in requests]
    return {"do_sample": [p.do_sample for p in params],
            "temperature": [p.temperature if p.do_sample else 1.0 for p in params],
            "top_k": [p.top_k for p in params], "top_p": [float(p.top_p) for p in params],
            "min_p": [float(p.min_p) for p in params], "seeds": [r.seed for r in requests], "positions": positions}


def sample_exactly(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """sample(), again with the sorted vocabulary when a top-k tie ran past the candidates (syncs)."""
    tokens, logprobs, tied = sample(logits, batch)
    if tied is not None and bool(tied.any()):
        tokens, logprobs, _ = sample(logits, dataclasses.replace(batch, kind=SamplerKind.SORTED))
    return tokens, logprobs


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Choose one token per row of logits [S, V]: (token ids int64 [S], their logprobs float32 [S], tied).

    The logits are penalised and masked first (`penalties`). Logprobs are log_softmax(logits / temperature) of the
    chosen token, of the model's logits, unpenalised and unfiltered (what a trainer recomputes); greedy rows use
    temperature 1. Candidate rows (candidate_top_k) filter the top CANDIDATES tokens, the other filtered rows the
    sorted vocabulary; a candidate row whose top-k kept every candidate (values tied with the k-th may lie beyond
    them) takes the sorted vocabulary's draw. The CANDIDATES sampler computes candidates only and `tied` (bool [S])
    flags those rows, to be sampled again with the SORTED sampler (sample_exactly); `tied` is None otherwise. A row's
    path and draw depend on its own parameters and logits only, not on the other rows. No host synchronisation."""
    raw = logits.float()
    scaled = _scaled(raw if batch.penalties is None else apply_penalties(raw, batch.penalties, batch.positions), batch)
    tokens, tied = scaled.argmax(dim=-1), None
    if batch.kind is not SamplerKind.GREEDY:
        if batch.kind is SamplerKind.SAMPLE:
            sampled = _gumbel_argmax(scaled, batch, None, scaled.shape[1])
        else:
            sampled, tied = _sample_filtered(scaled, batch)
        tokens = torch.where(batch.do_sample, sampled, tokens)
    return tokens, chosen_logprobs(scaled if batch.penalties is None else _scaled(raw, batch), tokens), tied


def _scaled(scores: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """scores / temperature; the scores themselves for the GREEDY sampler."""
    return scores if batch.kind is SamplerKind.GREEDY else scores / batch.temperature[:, None]


def chosen_logprobs(scaled: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(scaled [S, V])[row, tokens[row]]: the generator's logprobs, and a batch-invariant trainer's."""
    return torch.log_softmax(scaled, dim=-1).gather(1, tokens[:, None])[:, 0]


def _kernel_draws(scores: torch.Tensor) -> bool:
    """Whether `draw_kernel` draws: on NVIDIA GPUs, where its log is CUDA's logf, as torch's."""
    return scores.is_cuda and torch.version.hip is None


def _gumbel_argmax(scores: torch.Tensor, batch: SamplingBatch, token_ids: torch.Tensor | None,
                   vocab: int) -> torch.Tensor:
    """Index of max(scores + Gumbel noise) per row: a draw from softmax(scores). token_ids: the ids of scores'
    columns [S, N], None for the vocabulary in order. Where the columns are the whole vocabulary, each id is hashed
    once for all rows (a table, gathered for permuted rows): the same noise at a fraction of the work. On CUDA, the
    Triton kernel of `draw_kernel` draws the same noise."""
    if _kernel_draws(scores):
        from .draw_kernel import gumbel_argmax     # Triton: a GPU install's (`cb_sync[gpu]`), imported where used
        return gumbel_argmax(scores, batch.seeds, batch.positions, token_ids)
    n = scores.shape[1]
    if token_ids is not None and n != vocab:
        hashes = _token_hash(token_ids)
    else:
        table = _token_hash(torch.arange(n, device=scores.device))
        hashes = table[None] if token_ids is None else table[token_ids]
    u = _noise(batch.seeds, batch.positions, hashes)
    return (scores - torch.log(-torch.log(u))).argmax(dim=-1)


def _sample_filtered(scaled: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row: top-k (ties with the k-th value kept, as HF), then top-p, then min-p (each renormalising over what
    the previous kept), then a draw; over the top CANDIDATES tokens for candidate rows, over the sorted vocabulary
    for the others. Ties are ordered by token id on both paths, so both make the same draw."""
    vocab = scaled.shape[1]
    values, order = scaled.topk(min(CANDIDATES, vocab), dim=-1)
    order, by_id = order.sort(dim=-1)
    values, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    tokens, tied = _filter_and_draw(values, order.gather(1, by_value), batch, vocab)
    candidate_rows = candidate_top_k(batch.top_k)
    tied &= batch.do_sample & candidate_rows & (values.shape[1] < vocab)
    if batch.kind is SamplerKind.CANDIDATES:
        return tokens, tied
    values, order = scaled.sort(dim=-1, descending=True, stable=True)
    full, _ = _filter_and_draw(values, order, batch, vocab)
    return torch.where(candidate_rows & ~tied, tokens, full), None


def _filter_and_draw(values: torch.Tensor, order: torch.Tensor, batch: SamplingBatch,
                     vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Filters and draw over values [S, N] sorted descending (token ids `order`); whether top-k kept all N columns."""
    kth = values.gather(1, (batch.top_k.clamp(min=1, max=values.shape[1]) - 1)[:, None])
    keep = (batch.top_k[:, None] == 0) | (values >= kth)
    kept_all = keep[:, -1].clone()
    values = values.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(values, dim=-1)
    keep &= (probs.cumsum(dim=-1) - probs) < batch.top_p[:, None]
    values = values.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(values, dim=-1)
    keep &= probs >= batch.min_p[:, None] * probs[:, :1]
    values = values.masked_fill(~keep, float("-inf"))
    choice = _gumbel_argmax(values, batch, order, vocab)
    return order.gather(1, choice[:, None])[:, 0], kept_all
