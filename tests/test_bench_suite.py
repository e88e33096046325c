"""`python -m benchmarks suite --tiny`: every CPU-capable benchmark end to end on tiny models, results in --out."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from benchmarks import suite  # noqa: E402


@pytest.mark.slow
def test_tiny_suite_runs_every_cpu_part(tmp_path):
    assert suite.main(["--tiny", "--out", str(tmp_path)]) == {"throughput": "ok", "grpo": "ok"}
    rows = json.loads((tmp_path / "throughput.json").read_text())
    assert {(r["engine"], r["batch"]) for r in rows if r["lora"]} == {
        (engine, batch) for engine in ("cb_sync", "hf_generate") for batch in (2, 4)}
    assert all(r["tok_per_s"] > 0 and r["model"] == "qwen3-tiny" for r in rows)
    assert "hf_generate" in (tmp_path / "throughput.md").read_text()
    assert {r["engine"] for r in json.loads((tmp_path / "grpo.json").read_text())} >= {"cb_sync", "trl_generate"}


def test_a_failing_part_is_reported_and_the_others_run(tmp_path, monkeypatch):
    monkeypatch.setattr(suite, "TINY_PARTS", (("throughput", ["--tiny", "--batches", "nan"]),
                                              ("grpo", ["--tiny", "--backends", "cb_sync"])))
    outcome = suite.main(["--tiny", "--out", str(tmp_path)])
    assert outcome["throughput"] != "ok" and outcome["grpo"] == "ok"
    assert (tmp_path / "grpo.json").is_file() and not (tmp_path / "throughput.json").exists()


@pytest.mark.slow
def test_isolated_engines_run_in_processes_of_their_own(tmp_path):
    from benchmarks import throughput
    rows = throughput.main(["--tiny", "--isolate", "--engines", "hf_generate", "cb_sync", "--no-lora-engines",
                            "--out", str(tmp_path)])
    assert [(r["engine"], r["batch"]) for r in rows] == [("hf_generate", 2), ("hf_generate", 4), ("cb_sync", 2),
                                                         ("cb_sync", 4)]
    assert all(r["process"] == "own" and r["tok_per_s"] > 0 and len(r.get("call_s", [0])) in (1, 3) for r in rows)
    assert json.loads((tmp_path / "throughput.json").read_text())[-1]["engine"] == "cb_sync"
    names = {p.name for p in tmp_path.iterdir()}          # the engines' own files are merged and removed
    assert {"throughput.json", "throughput.md"} <= names <= {"throughput.json", "throughput.md", "throughput.png"}
