"""Paged attention: batch metadata, the function registered with transformers, and the backends."""

from .interface import (ATTN_IMPLEMENTATION, MissingBatchMetadata, StepBackends, paged_attention_forward,
                        select_backends)
from .metadata import AttnMetadata

__all__ = ["ATTN_IMPLEMENTATION", "AttnMetadata", "MissingBatchMetadata", "StepBackends", "paged_attention_forward",
           "select_backends"]
