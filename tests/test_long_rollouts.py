"""Workload L's benchmark on the CPU (tiny Qwen3): its rows, preemptions under a KV cap with no request lost, the
per-context step times, the merge of several runs' rows, and the KV cap's predicted cost (the real FIFOScheduler
replayed: no preemption where the cap holds the batch, preemptions, recomputed tokens and a slower clock where it does
not)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from benchmarks import harness, long_rollouts, throughput
from benchmarks.harness import KV_BYTES_PER_TOKEN, build_model, exit_code


@pytest.mark.slow
def test_tiny_run_writes_a_row_per_batch(tmp_path):
    rows = long_rollouts.main(["--tiny", "--out", str(tmp_path)])
    assert [(r["engine"], r["batch"]) for r in rows] == [("cb_sync_compiled", 2), ("cb_sync_compiled", 3)]
    assert all(r["tok_per_s"] > 0 and r["preemptions"] == r["recomputed_tokens"] == 0 and r["new_tokens"] == 40
               for r in rows)
    assert json.loads((tmp_path / "long_rollouts.json").read_text())[0]["batch"] == 2


@pytest.mark.slow
def test_a_kv_cap_below_the_batch_preempts_and_loses_no_request(tmp_path):
    """One driver serves a cap that holds the batch (no preemption), then a cap of 5 blocks of 16 tokens (the cache
    released and allocated again within it), where 3 requests of 48 tokens (3 blocks each) are preempted and
    recomputed; the engine process checks every completion is whole (it raises otherwise, and the row would carry
    the error)."""
    rows = long_rollouts.main(["--tiny", "--engines", "cb_sync", "--max-cache-gib", "1", "0.00004", "--out",
                               str(tmp_path)])
    assert all("error" not in r for r in rows), rows
    assert [(r["max_cache_gib"], r["batch"]) for r in rows] == [(1.0, 2), (1.0, 3), (0.00004, 2), (0.00004, 3)]
    assert rows[0]["preemptions"] == rows[1]["preemptions"] == 0 and rows[3]["preemptions"] > 0
    assert all((r["recomputed_tokens"] > 0) == (r["preemptions"] > 0) for r in rows), rows
    kinds = rows[3]["seconds_by_kind"]                   # the capped call recomputes: prefill or mixed steps
    assert any(k.endswith("decode") for k in kinds) and any(k.endswith(("prefill", "mixed")) for k in kinds)
    assert all(count > 0 and seconds >= 0 for count, seconds in kinds.values())
    assert "cap 4e-05 GiB" in (tmp_path / "long_rollouts.md").read_text()


def _step(path, read_at, context):
    chunk = SimpleNamespace(request=object(), start=context - 1, length=1)
    return SimpleNamespace(path=path, read_at=read_at, plan=[chunk])


def test_step_times_are_read_to_read_near_each_context():
    steps = long_rollouts.ContextSteps()
    for i, (path, at) in enumerate([("eager", 0.0), ("replay", 0.010), ("replay", 0.014), ("replay", 0.020)]):
        steps(_step(path, at, 1000 + i))
    steps(_step("replay", 1.0, 4096))
    assert steps.ms_at(1024) == 5.0                 # replays after replays only: 4 ms and 6 ms
    assert steps.ms_at(8192) is None


def test_decode_steps_are_bucketed_by_running_batch():
    steps, chunks = long_rollouts.ContextSteps(), lambda *ends: [SimpleNamespace(request=object(), start=e - 1,
                                                                                   length=1) for e in ends]
    for at, plan in [(0.0, chunks(9)), (0.002, chunks(10)), (0.005, chunks(10, 20, 30)), (0.009, chunks(11, 21)),
                     (0.010, [SimpleNamespace(request=object(), start=0, length=4)] + chunks(12))]:
        steps(SimpleNamespace(path="replay", read_at=at, plan=plan))
    assert steps.decode_by_batch() == {"1": [1, 0.002, 1.0, 10], "2-3": [2, 0.007, 2.5, 46]}


def test_recomputed_tokens_count_what_a_request_feeds_again_below_its_furthest_position():
    steps, request, other = long_rollouts.ContextSteps(), object(), object()
    for chunks in ([(request, 0, 10), (other, 0, 4)], [(request, 10, 1), (other, 4, 1)], [(other, 5, 1)],
                   [(request, 0, 8)], [(request, 8, 5)]):       # preempted at 11, fed again from 0 up to 13
        steps(SimpleNamespace(path="eager", read_at=0.0, plan=[
            SimpleNamespace(request=r, start=start, length=length) for r, start, length in chunks]))
    assert steps.recomputed == 11


def test_merge_keeps_measured_rows_and_drops_errors_measured_elsewhere(tmp_path):
    first = [{"engine": "cb_sync_compiled", "batch": 8, "sampler": "greedy", "tok_per_s": 10.0},
             {"engine": "cb_sync_compiled", "batch": 64, "sampler": "greedy", "error": "stopped"}]
    second = [{"engine": "cb_sync_compiled", "batch": 64, "sampler": "greedy", "tok_per_s": 30.0}]
    paths = []
    for i, rows in enumerate((first, second)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps([{**r, "lora": True, "seconds": 1, "peak_gib": 1} for r in rows]))
    merged = long_rollouts.main(["--from-json", *map(str, paths), "--name", "m", "--out", str(tmp_path)])
    assert [(r["batch"], r["tok_per_s"]) for r in merged] == [(8, 10.0), (64, 30.0)]
    caption, blank, *table, _, card = (tmp_path / "m.md").read_text().splitlines()
    assert caption.endswith("1,024-token prompts, 8,192 new tokens)") and not blank and card.startswith("Card: ")
    assert len(table) == 4                                              # header, rule, a row a batch


def test_merge_keeps_a_row_for_each_attention_backend_and_labels_it(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"engine": "cb_sync_compiled", "batch": 8, "sampler": "greedy", "lora": True,
                                 "seconds": 1, "peak_gib": 1, "tok_per_s": tok_per_s, **backend}
                                for tok_per_s, backend in ((10.0, {}), (12.0, {"attn_backend": "flash_prefill"}))]))
    merged = long_rollouts.main(["--from-json", str(path), "--name", "m", "--out", str(tmp_path)])
    assert [r["tok_per_s"] for r in merged] == [10.0, 12.0]
    assert "| cb_sync_compiled flash_prefill |" in (tmp_path / "m.md").read_text()


@pytest.mark.slow
def test_hf_generate_rows_and_the_ratio_to_them(tmp_path):
    rows = long_rollouts.main(["--tiny", "--engines", "cb_sync", "hf_generate", "--out", str(tmp_path)])
    assert {(r["engine"], r["batch"]) for r in rows if r.get("tok_per_s")} == {
        (e, b) for e in ("cb_sync", "hf_generate") for b in (2, 3)}
    assert "x hf_generate" in (tmp_path / "long_rollouts.md").read_text()


def test_rows_of_other_completion_lengths_stay_apart(tmp_path):
    """A merge of 8,192- and 16,384-token calls keeps both rows of a batch, and cb_sync's ratio is to the peer of
    its own length only; a call that left a row unmeasured exits non-zero."""
    def row(engine, new_tokens, tok_per_s=None):
        measured = {"tok_per_s": tok_per_s, "seconds": 1, "peak_gib": 1} if tok_per_s else {"error": "stopped"}
        return {"engine": engine, "batch": 8, "sampler": "greedy", "prompt_len": 1024, "new_tokens": new_tokens,
                "lora": engine != "vllm_nolora", **measured}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([row("cb_sync_compiled", 8192, 20.0), row("cb_sync_compiled", 16384, 30.0),
                                row("vllm", 8192, 10.0), row("vllm", 16384, 60.0), row("vllm", 8192)]))
    merged = long_rollouts.main(["--from-json", str(path), "--name", "m", "--out", str(tmp_path)])
    assert [(r["engine"], r["new_tokens"], r.get("tok_per_s")) for r in merged] == [
        ("cb_sync_compiled", 8192, 20.0), ("cb_sync_compiled", 16384, 30.0), ("vllm", 8192, 10.0),
        ("vllm", 16384, 60.0)]
    table = (tmp_path / "m.md").read_text()
    assert "2.00x vllm" in table and "0.50x vllm" in table and "3.00x" not in table and "1.00x" not in table
    assert exit_code(merged) == 0 and exit_code([row("vllm", 8192)]) == 1


@pytest.mark.slow
def test_the_static_cache_warm_up_call_stops_early_at_the_timed_calls_cache_length(monkeypatch):
    """HF `generate` with a static cache: the first (compiling) call keeps max_new_tokens, so the cache length and
    the compiled shapes of the timed call, but stops after warmup_tokens; the timed call decodes them all."""
    model = build_model(lora=True, tiny=True, device="cpu", dtype=torch.float32)
    calls, generate = [], model.generate
    monkeypatch.setattr(model, "generate", lambda ids, **kwargs: calls.append((kwargs, generate(ids, **kwargs)))
                        or calls[-1][1])
    _, _, extra = throughput.run_hf_generate(model, [list(range(1, 9))] * 2, 12, static=True, warmup_tokens=3)
    assert [out.shape for _, out in calls] == [(2, 11), (2, 20)] and extra["first_call_tokens"] == 3
    assert all(kwargs["max_new_tokens"] == 12 and kwargs["cache_implementation"] == "static" for kwargs, _ in calls)


def test_the_step_clock_times_hf_generate_by_length_and_stops_it_at_its_deadline():
    model = build_model(lora=True, tiny=True, device="cpu", dtype=torch.float32)
    prompts = harness.random_prompts(model.config.vocab_size, [2], 8)[2]
    clock = throughput.HFStepClock(time.monotonic() + 600)
    throughput.run_hf_generate(model, prompts, 12, clock=clock)
    assert sorted(clock.ends) == list(range(9, 21))              # every new token, by sequence length
    assert clock.ms_at(14, 2) > 0 and clock.ms_at(100, 2) is None
    stopped = throughput.HFStepClock(time.monotonic())              # already past: the call stops after one token
    throughput.run_hf_generate(model, prompts, 12, clock=stopped)
    assert list(stopped.ends) == [9]


def test_an_hf_call_stopped_at_the_time_limit_is_a_row_over_the_tokens_it_made(tmp_path, monkeypatch):
    """A call cut short (a clock that stops it after 5 tokens, as a deadline would) gives its rate over the tokens
    made, says so in its label and in cb_sync's ratio to it; a batch not started by the process's end is a row
    saying so."""
    class StopAfterFive(throughput.HFStepClock):
        def __call__(self, input_ids, scores, **kwargs):
            return super().__call__(input_ids, scores, **kwargs) | (input_ids.shape[1] >= 8 + 5)
    monkeypatch.setattr(throughput, "HFStepClock", StopAfterFive)
    shape = ["--tiny", "--engines", "hf_generate", "--engine-process", "--batches", "2", "3", "--prompt-len", "8",
             "--new-tokens", "40", "--out", str(tmp_path)]
    long_rollouts.main([*shape, "--stop-at", str(time.time() + 600)])
    got = json.loads((tmp_path / "long_rollouts.json").read_text())
    assert [(r["batch"], r["stopped_after_tokens"]) for r in got] == [(2, 5), (3, 5)]
    rate, seconds = got[0]["tok_per_s"], got[0]["seconds"]         # seconds rounded to 0.01: 2 x 5 tokens in them
    assert rate * seconds == pytest.approx(2 * 5, abs=rate * 0.005 + 0.1)
    cb = {"engine": "cb_sync_compiled", "batch": 2, "sampler": "greedy", "prompt_len": 8, "new_tokens": 40,
          "lora": True, "seconds": 1, "peak_gib": 1, "tok_per_s": got[0]["tok_per_s"] * 2}
    (tmp_path / "cb.json").write_text(json.dumps([cb]))
    long_rollouts.main(["--from-json", str(tmp_path / "cb.json"), str(tmp_path / "long_rollouts.json"), "--name", "m",
                        "--out", str(tmp_path)])
    text = (tmp_path / "m.md").read_text()
    assert "| hf_generate (its first 5 tokens: stopped at the time limit) |" in text
    assert "2.00x hf_generate (its first 5 tokens: stopped at the time limit)" in text
    long_rollouts.main([*shape, "--stop-at", str(time.time())])
    assert [r["error"] for r in json.loads((tmp_path / "long_rollouts.json").read_text())] == [
        "not run: --time-limit used up"] * 2


def test_ratios_compare_rows_of_the_same_card_only(tmp_path):
    def row(engine, gpu, tok_per_s):
        return {"engine": engine, "batch": 8, "sampler": "greedy", "prompt_len": 1024, "new_tokens": 8192,
                "lora": True, "seconds": 1, "peak_gib": 1, "tok_per_s": tok_per_s, "gpu": gpu}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([row("cb_sync_compiled", "NVIDIA H100 80GB HBM3", 30.0),
                                row("vllm", "NVIDIA H200", 10.0), row("vllm", "NVIDIA H100 80GB HBM3", 20.0)]))
    long_rollouts.main(["--from-json", str(path), "--name", "m", "--out", str(tmp_path)])
    cb_line = (tmp_path / "m.md").read_text().splitlines()[4]
    assert cb_line.endswith("| 1.50x vllm |"), cb_line


def test_contexts_a_call_never_decoded_at_read_as_a_dash_and_cb_sync_shows_its_warm_up(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"engine": "cb_sync_compiled", "batch": 32, "sampler": "greedy", "lora": True,
                                 "prompt_len": 8192, "new_tokens": 1024, "seconds": 1, "peak_gib": 1,
                                 "tok_per_s": 5.0, "ms_step_1024": None, "ms_step_4096": None, "ms_step_8192": 17.5,
                                 "warmup_s": 85.1, "gpu": "NVIDIA H100 80GB HBM3"}]))
    long_rollouts.main(["--from-json", str(path), "--name", "m", "--out", str(tmp_path)])
    lines = (tmp_path / "m.md").read_text().splitlines()
    assert lines[0] == "Workload L (Qwen3-4B shape + LoRA r32, 8,192-token prompts, 1,024 new tokens)"
    cells = [c.strip() for c in lines[4].split("|")]
    assert cells[7] == "- / - / 17.5 / -" and cells[12] == "85.1", cells


def test_gpu_state_reads_the_card_name(monkeypatch):
    out = "NVIDIA H100 80GB HBM3, 41, 1980, 120.5\n"
    monkeypatch.setattr(harness.subprocess, "run", lambda *a, **k: SimpleNamespace(stdout=out))
    assert harness.gpu_state() == {"gpu": "NVIDIA H100 80GB HBM3", "gpu_c": 41.0, "sm_mhz": 1980.0, "gpu_w": 120.5}


def test_engine_commands_carry_the_backend_and_an_hf_process_its_end(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(long_rollouts, "run_engines", lambda engines, command, expected, *a: seen.update(
        engines=engines, command=command, expected=expected) or [])
    long_rollouts.main(["--engines", "vllm", "cb_sync_compiled", "hf_generate", "--attn-backend", "flash_prefill",
                        "--time-limit", "100", "--out", str(tmp_path)])
    assert seen["engines"] == ["cb_sync_compiled", "hf_generate", "vllm"]            # vLLM last
    cb = seen["command"]("cb_sync_compiled", "n", 1000.0)
    assert cb[cb.index("--attn-backend") + 1] == "flash_prefill" and "--stop-at" not in cb
    start = time.time()
    hf = seen["command"]("hf_generate", "n", 1000.0)
    assert 0 <= float(hf[hf.index("--stop-at") + 1]) - (start + 1000.0 - long_rollouts.HF_EXIT_MARGIN_S) < 5
    assert "--stop-at" not in seen["command"]("hf_generate", "n", None)
    vllm = seen["command"]("vllm", "n", 1000.0)
    assert vllm[2:6] == ["benchmarks.peers", "vllm", "--engine", "vllm"] and "L" in vllm
    assert [(r["max_cache_gib"], r["batch"]) for r in seen["expected"]("cb_sync_compiled")] == [
        (96.0, 8), (96.0, 32), (96.0, 64)]


# -- a KV cap's predicted cost ------------------------------------------------------------------------------------

def _gib(blocks: int) -> float:
    return blocks * long_rollouts.BLOCK_SIZE * KV_BYTES_PER_TOKEN / 2**30


def test_a_cap_below_the_batch_preempts_recomputes_and_costs_time():
    roomy, tight = (long_rollouts.replay(3, 8, 40, _gib(blocks), 64) for blocks in (9, 5))
    assert (roomy["steps"], roomy["preemptions"], roomy["recomputed_tokens"]) == (40, 0, 0)
    assert tight["preemptions"] > 0 and tight["recomputed_tokens"] > 0
    assert tight["steps"] > roomy["steps"] and tight["tok_per_s"] < roomy["tok_per_s"]
    kinds, by_batch = roomy["seconds_by_kind"], roomy["decode_by_batch"]   # read to read: the first step uncounted
    assert kinds["replay decode"][0] == 39 and sum(n for n, _, _, _ in by_batch.values()) == 39
    assert abs(sum(s for _, s in kinds.values()) - sum(s for _, s, _, _ in by_batch.values())) < 1e-2
    assert set(by_batch) == {"2-3"} and "1" in tight["decode_by_batch"]       # preempted down to one request
    with pytest.raises(ValueError, match="cannot hold one request"):
        long_rollouts.replay(2, 8, 40, _gib(2), 64)


def test_a_clock_fitted_to_measured_steps_prices_the_replay(tmp_path):
    """Three uncapped rows' steps on a plane ms = a + b x requests + c x KV GB give that plane back, and the replay
    runs on it; capped rows and other engines are not fitted."""
    kv_gb = lambda batch, context: batch * context * KV_BYTES_PER_TOKEN / 1e9     # noqa: E731
    plane = lambda batch, context: 2.0 + 0.05 * batch + 0.3 * kv_gb(batch, context)   # noqa: E731
    rows = [{"engine": "cb_sync_compiled", "batch": b, "tok_per_s": 1.0, "preemptions": 0,
             **{f"ms_step_{c}": plane(b, c) for c in (1024, 4096)}} for b in (8, 32)]
    rows += [{"engine": "cb_sync_compiled", "batch": 64, "tok_per_s": 1.0, "preemptions": 5, "ms_step_1024": 99.0},
             {"engine": "vllm", "batch": 64, "tok_per_s": 1.0, "ms_step_1024": 99.0}]
    path = tmp_path / "steps.json"
    path.write_text(json.dumps(rows))
    clock, coefficients = long_rollouts.fitted_clock(path)
    assert coefficients == pytest.approx((2.0, 0.05, 0.3), abs=1e-4)
    assert clock([4096] * 16) == pytest.approx(plane(16, 4096))
    assert clock([4096, 1024, 10]) == pytest.approx(plane(3, 4096))     # the longest context sets the KV term
    assert long_rollouts.replay(3, 8, 40, _gib(9), 64, lambda contexts: 1000.0)["seconds"] == 40.0
    rows = long_rollouts.main(["--predict-caps", "1", str(_gib(5)), "--batches", "3", "--prompt-len", "8",
                               "--new-tokens", "40", "--step-times", str(path), "--out", str(tmp_path)])
    assert rows[0]["of_best"] == 1.0 > rows[1]["of_best"] and "x KV GB" in rows[0]["clock"]
    path.write_text(json.dumps(rows[2:]))
    with pytest.raises(ValueError, match="at least 3 needed"):
        long_rollouts.fitted_clock(path)
