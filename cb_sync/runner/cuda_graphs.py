"""The decode graphs' old path: they live in `cb_sync.graphs`."""

from ..graphs.buckets import bucket_for, decode_buckets, is_pure_decode
from ..graphs.capture import DecodeGraphs, model_fingerprint
from ..graphs.replay import DecodeReplay, ReplayOutput

__all__ = ["DecodeGraphs", "DecodeReplay", "ReplayOutput", "bucket_for", "decode_buckets", "is_pure_decode",
           "model_fingerprint"]
