"""Sampling on the device: the sampler (greedy, temperature, top-k / top-p / min-p, logprobs), its Triton draw, and
the penalties and masks applied before them."""

from .penalties import PenaltyBatch, PenaltyKind, TokenHistory, apply_penalties, penalty_kind
from .sampler import (CANDIDATES, MAX_CANDIDATE_TOP_K, SAMPLING_COLUMNS, SamplerKind, SamplingBatch, chosen_logprobs,
                      sample, sample_exactly, sampler_kind, sampling_columns, uniform_noise)

__all__ = ["CANDIDATES", "MAX_CANDIDATE_TOP_K", "SAMPLING_COLUMNS", "PenaltyBatch", "PenaltyKind", "SamplerKind",
           "SamplingBatch", "TokenHistory", "apply_penalties", "chosen_logprobs", "penalty_kind", "sample",
           "sample_exactly", "sampler_kind", "sampling_columns", "uniform_noise"]
