"""benchmarks.grpo --tiny: the GRPO benchmark end to end on the CPU (cb_sync, TRL generate, TRL CB; 3 steps), and
the equivalence gate of benchmarks.grpo_stats."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from benchmarks import grpo  # noqa: E402
from benchmarks.__main__ import main as dispatch  # noqa: E402
from benchmarks.grpo_stats import compare  # noqa: E402

RAN = ("cb_sync", "trl_generate", "trl_cb")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo")
    rows = grpo.main(["--tiny", "--out", str(out)])
    return out, {r["engine"]: r for r in rows}


@pytest.mark.slow
def test_tiny_suite_writes_results(tiny_run):
    out, rows = tiny_run
    assert list(rows) == list(grpo.BACKENDS)
    for name in ["grpo.json", "grpo.md"] + [f"grpo_{b}.json" for b in RAN]:
        assert (out / name).is_file(), name
    saved = {r["engine"]: r for r in json.loads((out / "grpo.json").read_text())}
    assert set(saved) == set(grpo.BACKENDS) and saved["cb_sync"]["card"] == "cpu"
    per_backend = json.loads((out / "grpo_cb_sync.json").read_text())
    assert per_backend["backend"] == "cb_sync" and len(per_backend["steps"]) == 3
    table = (out / "grpo.md").read_text()
    assert "## cb_sync per step" in table and "Equivalence gate" in table and "logprob gap" in table
    if importlib.util.find_spec("vllm") is None:
        assert "not installed" in rows["trl_vllm"]["skipped"] and "not installed" in rows["trl_vllm_sleep"]["skipped"]
    assert "needs a CUDA device" in rows["unsloth"]["skipped"] or "holds no unsloth" in rows["unsloth"]["skipped"]


@pytest.mark.slow
def test_tiny_suite_trains_every_backend(tiny_run):
    _, rows = tiny_run
    fingerprints = {json.dumps(rows[b]["init_fingerprint"], sort_keys=True) for b in RAN}
    assert len(fingerprints) == 1                       # every backend starts from the same weights
    for backend in RAN:
        row = rows[backend]
        assert "error" not in row, row.get("error")
        steps = row["per_step"]
        assert [s["step"] for s in steps] == [1, 2, 3]
        for s in steps:
            assert math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) and s["grad_norm"] > 0
            assert s["step_s"] > 0 and s["peak_gib"] is None          # CPU: no GPU memory
            assert s["completion_len"] == 8                           # EOS silenced: completions run to length
            assert s["reward_std"] > 0 and s["kl"] >= 0
        assert row["step_ms"] > 0 and row["timed_steps"] == 2         # 1 warm-up step left out


@pytest.mark.slow
def test_tiny_suite_gate_and_logprob_gap(tiny_run):
    _, rows = tiny_run
    for backend in ("cb_sync", "trl_cb"):
        gate = rows[backend]["gate"]
        assert gate["pass"] is True, gate
        assert {"steps", "losses_finite", "rewards_in_range", "signal", "kl_close"} <= set(gate["checks"])
    assert rows["trl_generate"]["gate_self"]["pass"] is True
    for s in rows["cb_sync"]["per_step"]:
        assert 0.0 <= s["logp_gap_mean"] <= s["logp_gap_max"] < 1e-3   # fp32: generator and trainer agree
    assert rows["cb_sync"]["gate"]["checks"]["logp_gap"]["pass"] is True
    assert all("logp_gap_mean" not in s for s in rows["trl_generate"]["per_step"])


def test_compare_flags_failures():
    ref = [{"step": i, "loss": 0.1, "reward": 1.0, "reward_std": 0.5, "kl": 0.01, "grad_norm": 1.0} for i in (1, 2)]
    good = [{**r, "kl": 0.012} for r in ref]
    assert compare(ref, good, 1e-3, reward_range=(-1, 2), kl_rtol=0.5)["pass"] is True
    bad_loss = [{**ref[0], "loss": float("nan")}, ref[1]]
    assert compare(ref, bad_loss, 1e-3)["checks"]["losses_finite"]["pass"] is False
    out_of_range = [{**r, "reward": 5.0} for r in ref]
    assert compare(ref, out_of_range, 1e-3, reward_range=(-1, 2))["checks"]["rewards_in_range"]["pass"] is False
    far = [{**r, "kl": 0.5} for r in ref]
    result = compare(ref, far, 1e-3, kl_rtol=0.5)
    assert result["pass"] is False and result["checks"]["kl_close"]["max_abs_diff"] == pytest.approx(0.49)
    assert compare(ref, ref[:1], 1e-3)["checks"]["steps"]["pass"] is False
    assert compare(ref[:1], ref, 1e-3, expected_steps=2)["checks"]["steps"]["pass"] is True
    flat = [{**r, "reward_std": 0.0, "grad_norm": 0.0} for r in ref]       # zero advantages: nothing learnt
    assert compare(ref, flat, 1e-3)["checks"]["signal"]["pass"] is False
    no_kl = [{k: v for k, v in r.items() if k != "kl"} for r in ref]
    assert compare(no_kl, no_kl, 1e-3)["checks"]["kl_close"]["pass"] is None


def test_dispatch(capsys):
    with pytest.raises(SystemExit) as info:
        dispatch(["no_such_benchmark"])
    assert info.value.code == 2 and "grpo" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        dispatch(["grpo", "--help"])
    assert info.value.code == 0 and "--max-completion" in capsys.readouterr().out
