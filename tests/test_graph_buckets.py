"""Bucket selection and pure-decode detection."""

from __future__ import annotations

import pytest

from cb_sync.config import SamplingParams
from cb_sync.graphs import bucket_for, decode_buckets, is_pure_decode
from cb_sync.scheduler import Request, ScheduledChunk


def test_buckets():
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert decode_buckets(128)[-3:] == [96, 112, 128]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(1) == [1]
    buckets = decode_buckets(64)
    assert [bucket_for(n, buckets) for n in (1, 3, 9, 24, 25, 64)] == [1, 4, 16, 24, 32, 64]
    with pytest.raises(ValueError, match="65 requests exceed the largest decode bucket 64"):
        bucket_for(65, buckets)


def _request(prompt_len, output_len):
    request = Request(0, [1] * prompt_len, SamplingParams(), seed=0, eos_ids=frozenset())
    request.output = [2] * output_len
    return request


def test_pure_decode_detection():
    decoding = _request(5, 2)
    assert is_pure_decode([ScheduledChunk(decoding, 6, 1)])
    assert not is_pure_decode([ScheduledChunk(decoding, 6, 1), ScheduledChunk(_request(9, 0), 0, 9)])
    assert not is_pure_decode([ScheduledChunk(_request(9, 0), 8, 1), ScheduledChunk(_request(9, 0), 0, 1)])
    assert is_pure_decode([ScheduledChunk(_request(1, 0), 0, 1)])    # one-token prompt: static shape too
