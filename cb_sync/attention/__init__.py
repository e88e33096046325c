"""Paged attention: batch metadata, the function registered with transformers, and the backends."""

from . import invariant
from .interface import ATTN_IMPLEMENTATION, paged_attention_forward, select_backend
from .metadata import AttnMetadata

__all__ = ["invariant", "ATTN_IMPLEMENTATION", "AttnMetadata", "paged_attention_forward", "select_backend"]
