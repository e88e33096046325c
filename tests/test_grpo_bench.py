"""benchmarks.grpo --tiny: the GRPO benchmark end to end on the CPU (cb_sync, TRL generate, TRL CB; workload G in 3
steps, G2 in 2), G2's settings and stop tokens, and the equivalence gate of benchmarks.grpo_stats."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from benchmarks import grpo, grpo_peers  # noqa: E402
from benchmarks.__main__ import main as dispatch  # noqa: E402
from benchmarks.grpo_stats import compare  # noqa: E402
from benchmarks.grpo_workload import make_dataset, make_tokenizer, stop_probability, stop_token_ids  # noqa: E402

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
        assert row["rollout_tok_s"] > 0 and "completion_lens" not in steps[0]
    cb = rows["cb_sync"]
    assert cb["driver_alone_s"] > 0 and cb["driver_alone_same_tokens"] is True
    assert cb["rollout_vs_driver"] == round(cb["last_rollout_s"] / cb["driver_alone_s"], 3)
    assert cb["last_rollout_s"] == round(cb["per_step"][-1]["gen_s"], 3)


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


def test_tiny_g2_eos_live(tmp_path):
    rows = {r["engine"]: r for r in grpo.main(["--tiny", "--workload", "G2", "--backends", *RAN,
                                               "--out", str(tmp_path)])}
    for backend in RAN:
        row = rows[backend]
        assert "error" not in row, row.get("error")
        assert row["workload"] == "G2" and row["batch"] == 8 and row["stop_tokens"] == 53
        assert 64 <= row["prompt_len_min"] < row["prompt_len_max"] <= 512
        steps = row["per_step"]
        assert [s["step"] for s in steps] == [1, 2]
        lengths = [n for s in steps for n in s["completion_lens"]]
        assert all(len(s["completion_lens"]) == 8 for s in steps)
        assert all(1 <= n <= 16 for n in lengths) and len(set(lengths)) > 1 and min(lengths) < 16   # EOS live
        assert row["len_count"] == 16 and row["len_max"] == max(lengths) and row["rollout_tok_s"] > 0
        assert row["len_p50"] <= row["len_p90"] <= row["len_max"]
    cb = rows["cb_sync"]
    assert cb["gate"]["pass"] is True, cb["gate"]
    assert cb["driver_alone_s"] > 0 and len(cb["driver_alone_runs_s"]) == 2 and cb["rollout_vs_driver"] > 0
    assert cb["driver_alone_same_tokens"] is True      # sampled, EOS live: the repeat drew what the rollout drew
    assert "driver_alone_s" not in rows["trl_generate"]
    table = (tmp_path / "grpo.md").read_text()
    for text in ("# Workload G2", "2 prompts x 4 generations", "2 micro-batches of 4", "53 stop tokens",
                 "GRPOConfig's defaults, left unset (temperature 1.0, top_p 1.0, top_k 0, min_p None)",
                 "## Completion lengths", "driver alone ms", f"{1000 * cb['driver_alone_s']:.1f} ("):
        assert text in table, text


def test_tiny_g2_grouped_by_length(tmp_path):
    row = grpo.main(["--tiny", "--workload", "G2", "--backends", "cb_sync", "--cb-group-by-length", "on",
                     "--out", str(tmp_path)])[0]
    assert "error" not in row, row.get("error")
    assert row["cb_group_by_length"] is True and [s["step"] for s in row["per_step"]] == [1, 2]
    assert all(s["grad_norm"] > 0 for s in row["per_step"])


def test_hook_probe_runs_g2_with_a_profiled_step(tmp_path):
    """benchmarks.grpo_hook on tiny G2: a row per trainer rollout (8 requests each) and per driver-alone call, the
    phases of every step, and the profiled step's tables."""
    from benchmarks import grpo_hook
    result = grpo_hook.main(["--tiny", "--workload", "G2", "--steps", "2", "--alone", "1", "--variants", "as_left",
                             "--profile-step", "2", "--out", str(tmp_path)])
    rollouts = [r for r in result["rows"] if r["what"] == "trainer rollout"]
    assert [r["step"] for r in rollouts] == [1, 2] and all(r["s"] > 0 for r in rollouts)
    assert [r["what"] for r in result["rows"][2:]] == ["driver alone, as_left"]
    assert sorted(result["facts"]["phases"]) == [1, 2] and len(result["facts"]["step_s"]) == 2
    assert "sorted by cpu_time_total" in (tmp_path / "grpo_hook_step.txt").read_text()


def test_g2_settings_reach_trl_and_the_peers(tmp_path):
    args = grpo.parse_args(["--tiny", "--workload", "G2", "--model", "qwen3-1.7b", "--out", str(tmp_path)])
    config = grpo.grpo_config(args, str(tmp_path), args.work)
    assert config.generation_batch_size == 8 and config.steps_per_generation == config.gradient_accumulation_steps == 2
    assert (config.temperature, config.top_p, config.top_k, config.min_p) == (1.0, 1.0, 0, None)
    assert config.max_completion_length == 16 and args.shots == (3, 28) and args.cb_max_batch_tokens == 2048
    full = grpo.parse_args(["--workload", "G2"]).work
    assert (full.rollout, full.micro_batch, full.accumulation, full.max_completion) == (64, 16, 4, 1024)
    command = grpo_peers.child_command("trl_vllm", args, tmp_path / "r.json", None)
    child = grpo.parse_args(command[3:])
    assert (child.workload, child.model, child.shots, child.max_completion) == ("G2", "qwen3-1.7b", (3, 28), 16)
    assert child.sdpa_cudnn == "on"
    off = grpo.parse_args(["--tiny", "--sdpa-cudnn", "off"])
    assert grpo.parse_args(grpo_peers.child_command("unsloth", off, tmp_path / "r.json", None)[3:]).sdpa_cudnn == "off"
    stops = [1, 500, 511]
    assert grpo_peers.trl_vllm_kwargs(False, stops)["generation_kwargs"] == {"stop_token_ids": stops}
    assert "generation_kwargs" not in grpo_peers.trl_vllm_kwargs(False)
    g = grpo.parse_args(["--tiny"])
    assert (g.workload, g.shots, g.max_completion, g.cb_max_batch_tokens, g.steps) == ("G", 6, 8, 512, 3)


def test_stop_tokens_give_the_target_mean():
    p = stop_probability(1024, 400)
    assert (1 - (1 - p) ** 1024) / p == pytest.approx(400, rel=1e-6)
    stops = stop_token_ids(151936, 1, 1024, 400)
    assert len(stops) == len(set(stops)) == 342 and stops[0] == 1 and max(stops) == 151935
    assert len(stop_token_ids(512, 1, 16, 8)) == 53
    tokenizer = make_tokenizer(512)
    prompts = list(make_dataset(n=128, shots=(3, 28), seed=0)["prompt"])
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    assert 64 <= min(lengths) and max(lengths) <= 512 and max(lengths) - min(lengths) > 300
    g_prompt = make_dataset(n=1, shots=6, seed=0)[0]["prompt"]            # workload G's prompts as they were
    assert len(tokenizer(g_prompt, add_special_tokens=False)["input_ids"]) == 130


def test_training_half_probe_trains_every_variant_on_the_same_completions(tmp_path):
    """benchmarks.grpo_training: the synthetic rollouts give every variant the same completions; the grouped
    variant's forwards are widened to multiples of WIDTH_MULTIPLE, width1's are not, TRL's micro-batches are wider."""
    from benchmarks import grpo_training
    from cb_sync.integrations.trl.length_groups import WIDTH_MULTIPLE

    rows = grpo_training.main(["--tiny", "--variants", "grouped", "width1", "ungrouped", "--out", str(tmp_path)])
    lengths = [[step["completion_lens"] for step in row["per_step"]] for row in rows]
    assert len(lengths[0]) == 2 and len(lengths[0][0]) == 8 and lengths[0] == lengths[1] == lengths[2]
    grouped, width1, ungrouped = ([w for step in row["per_step"] for w in step["forward_widths"]] for row in rows)
    assert any(w % WIDTH_MULTIPLE == 0 for w in grouped) and any(w % WIDTH_MULTIPLE for w in width1)
    assert rows[2]["forward_tokens_per_step"] > rows[1]["forward_tokens_per_step"]    # trimmed: fewer columns
    assert all(row["median_step_s"] > 0 and row["forward_tokens_per_step"] > 0 for row in rows)
    assert "| grouped |" in (tmp_path / "grpo_training.md").read_text()
