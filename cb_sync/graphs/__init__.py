"""CUDA-graph capture, replay and invalidation of pure-decode steps."""

from .decode_graphs import DecodeGraphs, bucket_for, decode_buckets, is_pure_decode, model_fingerprint

__all__ = ["DecodeGraphs", "bucket_for", "decode_buckets", "is_pure_decode", "model_fingerprint"]
