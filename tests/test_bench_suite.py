"""`python -m benchmarks`: the dispatcher, `all --tiny` (Workloads T and G end to end on the CPU) and Workload T's
engines in processes of their own."""

from __future__ import annotations

import json

import pytest

from benchmarks import __main__ as dispatcher
from benchmarks import throughput


def test_dispatch(capsys):
    with pytest.raises(SystemExit) as info:
        dispatcher.main(["no_such_benchmark"])
    assert info.value.code == 2 and "long_rollouts" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        dispatcher.main(["grpo", "--help"])
    assert info.value.code == 0 and "--synthetic-rollouts" in capsys.readouterr().out


def test_a_failing_part_is_reported_and_the_others_run(tmp_path, monkeypatch):
    monkeypatch.setattr(dispatcher, "ALL", {"throughput": ["--batches", "nan"], "long_rollouts": [
        "--predict-caps", "1", "--batches", "2", "--prompt-len", "8", "--new-tokens", "8"]})
    outcome = dispatcher.main(["all", "--tiny", "--out", str(tmp_path)])
    assert outcome == {"throughput": outcome["throughput"], "long_rollouts": "ok"} and outcome["throughput"] != "ok"
    assert (tmp_path / "long_rollouts" / "preemption_model.json").is_file() and not (tmp_path / "throughput").exists()


@pytest.mark.slow
def test_tiny_all_runs_every_cpu_part(tmp_path):
    pytest.importorskip("trl")
    assert dispatcher.main(["all", "--tiny", "--out", str(tmp_path)]) == {"throughput": "ok", "grpo": "ok"}
    rows = json.loads((tmp_path / "throughput" / "throughput.json").read_text())
    assert {(r["engine"], r["batch"]) for r in rows} == {(e, b) for e in ("cb_sync", "hf_generate") for b in (2, 4)}
    assert all(r["tok_per_s"] > 0 and r["model"] == "qwen3-tiny" and r["card"] == "cpu" for r in rows)
    assert rows[0]["cb_compiled"] is False and rows[0]["cb_batch_invariant"] is False
    text = (tmp_path / "throughput" / "throughput.md").read_text()
    assert "x hf_generate" in text and "Card: cpu; date: " in text
    assert {r["engine"] for r in json.loads((tmp_path / "grpo" / "grpo_g.json").read_text())} >= {"cb_sync",
                                                                                                   "trl_generate"}


@pytest.mark.slow
def test_isolated_engines_run_in_processes_of_their_own(tmp_path):
    rows = throughput.main(["--tiny", "--isolate", "--engines", "hf_generate", "cb_sync_exact", "--out", str(tmp_path)])
    assert [(r["engine"], r["batch"]) for r in rows] == [("hf_generate", 2), ("hf_generate", 4), ("cb_sync_exact", 2),
                                                         ("cb_sync_exact", 4)]
    assert all(r["process"] == "own" and r["tok_per_s"] > 0 for r in rows)
    assert rows[-1]["cb_batch_invariant"] is True and len(rows[-1]["call_s"]) == 3
    names = {p.name for p in tmp_path.iterdir()}          # the engines' own files are merged and removed
    assert {"throughput.json", "throughput.md"} <= names <= {"throughput.json", "throughput.md", "throughput.png"}


@pytest.mark.slow
def test_profile_writes_a_kernel_table_per_batch(tmp_path):
    rows = throughput.main(["--tiny", "--engines", "cb_sync_exact", "--profile", "--out", str(tmp_path)])
    for batch in (r["batch"] for r in rows):
        table = (tmp_path / f"throughput_cb_sync_exact_b{batch}_profile.txt").read_text()
        assert "Self CPU time total" in table and "aten::" in table


@pytest.mark.slow
def test_the_exact_modes_logprob_gap_is_zero(tmp_path):
    rows = throughput.main(["--tiny", "--logprob-gap", "--temperatures", "1.0", "--out", str(tmp_path)])
    gaps = {r["engine"]: r for r in rows}
    assert gaps["cb_sync_exact"]["bitwise_equal"] and gaps["cb_sync_exact"]["gap_max"] == 0.0
    assert 0 < gaps["cb_sync"]["gap_max"] < 1e-3                      # fp32: close, not equal
    assert "| 1.0 | cb_sync_exact |" in (tmp_path / "logprob_gap.md").read_text()
