"""CUDA-graph capture and replay of pure-decode steps."""

from .buckets import bucket_for, decode_buckets, is_pure_decode

__all__ = ["bucket_for", "decode_buckets", "is_pure_decode"]
