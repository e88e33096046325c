"""Sampling on the device: the sampler (greedy, temperature, top-k / top-p / min-p, logprobs) and its Triton draw."""

from .sampler import (
                      CANDIDATES,
                      MAX_CANDIDATE_TOP_K,
                      SAMPLING_COLUMNS,
                      SamplerKind,
                      SamplingBatch,
                      chosen_logprobs,
                      sample,
                      sample_exactly,
                      sampler_kind,
                      sampling_columns,
                      uniform_noise,
)

__all__ = ["CANDIDATES", "MAX_CANDIDATE_TOP_K", "SAMPLING_COLUMNS", "SamplerKind", "SamplingBatch", "chosen_logprobs",
           "sample", "sample_exactly", "sampler_kind", "sampling_columns", "uniform_noise"]
