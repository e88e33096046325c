"""The command line: `cb-sync` / `python -m cb_sync`, its version, help and errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import cb_sync
from cb_sync.cli import main, tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_python_dash_m_runs_the_command_line():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "cb_sync", "--version"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"cb-sync {cb_sync.__version__}"


WITHOUT_TRITON = """
import importlib.abc, sys
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NoTriton())
from cb_sync.cli import main, tiny_model
main(["demo", "--prompts", "3", "--max-new-tokens", "4"])
assert not any(name.split(".")[0] == "triton" for name in sys.modules)
"""


@pytest.mark.slow
def test_the_demo_runs_where_triton_is_not_installed():
    """The CPU quick start installs torch's CPU wheel and cb_sync without extras: no Triton."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "greedy tokens equal to HF generate: 3/3" in done.stdout


def test_demo_options_have_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option, text in [("--prompts", "random prompts"), ("--max-new-tokens", "tokens per prompt"),
                         ("--seed", "seed of the model")]:
        assert option in out and text in out


@pytest.mark.parametrize("argv,option", [(["--prompts", "-1"], "--prompts"), (["--prompts", "0"], "--prompts"),
                                         (["--max-new-tokens", "0"], "--max-new-tokens"),
                                         (["--prompts", "many"], "--prompts")])
def test_bad_values_give_a_one_line_error_and_exit_code_2(capsys, argv, option):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *argv])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert errors == [f"cb-sync demo: error: argument {option}: must be a positive int, got {argv[1]!r}"]


def test_demo_runs(capsys):
    assert main(["demo", "--prompts", "2", "--max-new-tokens", "3"]) == 0
    assert "greedy tokens equal to HF generate: 2/2" in capsys.readouterr().out


def test_demo_times_each_engine_after_a_warm_up_call(monkeypatch, capsys):
    """The first call in a process pays one-off costs: each engine's timed call must follow an untimed one of its
    own, so the printed speeds compare warm engines (a fake clock marks where the timed regions lie)."""
    import cb_sync.cli as cli
    from cb_sync import SyncCBDriver
    events = []

    def clock() -> float:
        events.append("clock")
        return float(len(events))
    monkeypatch.setattr(cli, "perf_counter", clock)
    driver_generate = SyncCBDriver.generate
    monkeypatch.setattr(SyncCBDriver, "generate", lambda self, *a, **k: events.append("cb_sync")
                        or driver_generate(self, *a, **k))

    def logged_model(seed):
        model = tiny_model(seed)
        model_generate = model.generate
        model.generate = lambda *a, **k: events.append("hf") or model_generate(*a, **k)
        return model
    monkeypatch.setattr(cli, "tiny_model", logged_model)
    assert main(["demo", "--prompts", "2", "--max-new-tokens", "3"]) == 0
    assert "greedy tokens equal to HF generate: 2/2" in capsys.readouterr().out
    clocks = [i for i, event in enumerate(events) if event == "clock"]
    assert len(clocks) == 4
    for start, stop in zip(clocks[::2], clocks[1::2]):
        timed = set(events[start + 1:stop])
        assert len(timed) == 1, events
        assert timed <= set(events[:start]), f"{timed} timed on its first call: {events}"
