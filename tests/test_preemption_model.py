"""The KV-cap prediction replays the real Scheduler: no preemption where the cap holds the batch (one step a token),
preemptions, recomputed tokens and a slower clock where it does not, and a clear error where one request cannot fit."""

from __future__ import annotations

import pytest

from benchmarks import preemption_model
from benchmarks.common import KV_BYTES_PER_TOKEN


def _gib(blocks: int) -> float:
    return blocks * preemption_model.BLOCK_SIZE * KV_BYTES_PER_TOKEN / 2**30


def test_a_cap_below_the_batch_preempts_recomputes_and_costs_time():
    roomy, tight = (preemption_model.replay(3, 8, 40, _gib(blocks), 64) for blocks in (9, 5))
    assert (roomy["steps"], roomy["preemptions"], roomy["recomputed_tokens"]) == (40, 0, 0)
    assert tight["preemptions"] > 0 and tight["recomputed_tokens"] > 0
    assert tight["steps"] > roomy["steps"] and tight["tok_per_s"] < roomy["tok_per_s"]


def test_a_cap_that_cannot_hold_one_request_is_a_value_error():
    with pytest.raises(ValueError, match="cannot hold one request"):
        preemption_model.replay(2, 8, 40, _gib(2), 64)
