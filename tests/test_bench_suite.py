"""`python -m benchmarks`: the dispatcher, `all --tiny` (Workloads T and G end to end on the CPU) and Workload T's
engines in processes of their own."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import __main__ as dispatcher
from benchmarks import harness, throughput

ROOT = Path(__file__).parent.parent


def test_dispatch(capsys):
    with pytest.raises(SystemExit) as info:
        dispatcher.main(["no_such_benchmark"])
    assert info.value.code == 2 and "long_rollouts" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        dispatcher.main(["grpo", "--help"])
    assert info.value.code == 0 and "--synthetic-rollouts" in capsys.readouterr().out


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


def copy_of_the_project(dest: Path) -> Path:
    for name in ("cb_sync/__init__.py", "cb_sync/config.py", "benchmarks/harness.py"):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, dest / name)
    return dest


def repository(path: Path) -> Path:
    path.mkdir(exist_ok=True)
    git(path, "init", "-q")
    (path / "README").write_text("another project\n")
    git(path, "add", ".")
    git(path, "commit", "-qm", "another project")
    return path


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_commit_recorded_is_this_projects_else_a_hash_of_the_files_run(tmp_path):
    other = repository(tmp_path / "other")
    copy = copy_of_the_project(other / "vendored")
    recorded = harness.commit(copy)
    assert recorded.startswith("files:") and git(other, "rev-parse", "--short", "HEAD") not in recorded
    git(other, "add", ".")
    git(other, "commit", "-qm", "vendored")          # tracked by the other repository: still not its commit
    assert harness.commit(copy) == recorded
    assert harness.commit(copy_of_the_project(repository(tmp_path / "top"))) == recorded     # at its top, untracked
    assert harness.commit(copy_of_the_project(tmp_path / "bare")) == recorded                 # in no repository
    (copy / "cb_sync" / "config.py").write_text("# changed\n")
    assert harness.commit(copy).startswith("files:") and harness.commit(copy) != recorded
    own = copy_of_the_project(tmp_path / "own")      # a checkout of its own: its commit, marked where it differs
    git(own, "init", "-q")
    git(own, "add", ".")
    git(own, "commit", "-qm", "own")
    assert harness.commit(own) == git(own, "rev-parse", "--short", "HEAD")
    (own / "benchmarks" / "harness.py").write_text("# changed\n")
    assert harness.commit(own) == git(own, "rev-parse", "--short", "HEAD") + "+changes"


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
