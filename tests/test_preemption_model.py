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
    kinds, by_batch = roomy["seconds_by_kind"], roomy["decode_by_batch"]   # read to read: the first step uncounted
    assert kinds["replay decode"][0] == 39 and sum(n for n, _, _, _ in by_batch.values()) == 39
    assert abs(sum(s for _, s in kinds.values()) - sum(s for _, s, _, _ in by_batch.values())) < 1e-2
    assert set(by_batch) == {"2-3"} and "1" in tight["decode_by_batch"]       # preempted down to one request


def test_a_cap_that_cannot_hold_one_request_is_a_value_error():
    with pytest.raises(ValueError, match="cannot hold one request"):
        preemption_model.replay(2, 8, 40, _gib(2), 64)


def test_a_clock_fitted_to_measured_steps_prices_the_replay(tmp_path):
    """Three uncapped rows' steps on a plane ms = a + b x requests + c x KV GB give that plane back, and the replay
    runs on it; capped rows and other engines are not fitted."""
    import json
    kv_gb = lambda batch, context: batch * context * KV_BYTES_PER_TOKEN / 1e9     # noqa: E731
    plane = lambda batch, context: 2.0 + 0.05 * batch + 0.3 * kv_gb(batch, context)   # noqa: E731
    rows = [{"engine": "cb_sync_compiled", "batch": b, "tok_per_s": 1.0, "preemptions": 0,
             **{f"ms_step_{c}": plane(b, c) for c in (1024, 4096)}} for b in (8, 32)]
    rows += [{"engine": "cb_sync_compiled", "batch": 64, "tok_per_s": 1.0, "preemptions": 5, "ms_step_1024": 99.0},
             {"engine": "vllm", "batch": 64, "tok_per_s": 1.0, "ms_step_1024": 99.0}]
    path = tmp_path / "steps.json"
    path.write_text(json.dumps(rows))
    clock, coefficients = preemption_model.fitted_clock(path)
    assert coefficients == pytest.approx((2.0, 0.05, 0.3), abs=1e-4)
    assert clock([4096] * 16) == pytest.approx(plane(16, 4096))
    assert clock([4096, 1024, 10]) == pytest.approx(plane(3, 4096))     # the longest context sets the KV term
    one_second = preemption_model.replay(3, 8, 40, _gib(9), 64, lambda contexts: 1000.0)
    assert one_second["seconds"] == 40.0                # 40 steps of 1 s (and 24 prefilled tokens, ~0.5 ms)
    path.write_text(json.dumps(rows[2:]))
    with pytest.raises(ValueError, match="at least 3 needed"):
        preemption_model.fitted_clock(path)
