"""CUDA-graph capture and replay of pure-decode steps, and the compiled forward they record."""

from .buckets import bucket_for, decode_buckets, is_pure_decode
from .capture import DecodeGraphs, model_fingerprint
from .compiled import CompiledForward, eager_forward
from .replay import DecodeReplay, ReplayOutput

__all__ = ["CompiledForward", "DecodeGraphs", "DecodeReplay", "ReplayOutput", "bucket_for", "decode_buckets",
           "eager_forward", "is_pure_decode", "model_fingerprint"]
