"""benchmarks.grpo on the CPU: Workloads G and G2 end to end on the tiny model (cb_sync, TRL generate, TRL CB), the
synthetic rollouts of the training half, data parallel ranks, the driver alone repeating a rollout, G2's settings and
stop tokens, and the equivalence gate."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from benchmarks import grpo  # noqa: E402
from benchmarks.grpo_stats import compare  # noqa: E402
from benchmarks.harness import build_model, make_tokenizer  # noqa: E402

RAN = ("cb_sync", "trl_generate", "trl_cb")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo")
    rows = grpo.main(["--tiny", "--out", str(out)])
    return out, {r["engine"]: r for r in rows}


@pytest.mark.slow
def test_tiny_run_writes_results(tiny_run):
    out, rows = tiny_run
    assert list(rows) == ["cb_sync", "trl_generate", "trl_cb", "trl_vllm", "trl_vllm_sleep", "unsloth"]
    assert {p.name for p in out.iterdir()} <= {"grpo_g.json", "grpo_g.md", "grpo_g.png"}   # steps are in the rows
    saved = {r["engine"]: r for r in json.loads((out / "grpo_g.json").read_text())}
    assert saved["cb_sync"]["card"] == "cpu" and saved["cb_sync"]["cb_compiled"] is False
    table = (out / "grpo_g.md").read_text()
    assert "## cb_sync per step" in table and "Equivalence gate" in table and "Card: cpu" in table
    if importlib.util.find_spec("vllm") is None:
        assert "not installed" in rows["trl_vllm"]["skipped"]
    assert "needs a CUDA device" in rows["unsloth"]["skipped"] or "holds no unsloth" in rows["unsloth"]["skipped"]


@pytest.mark.slow
def test_tiny_run_trains_every_backend(tiny_run):
    _, rows = tiny_run
    assert len({json.dumps(rows[b]["init_fingerprint"], sort_keys=True) for b in RAN}) == 1   # the same weights
    for backend in RAN:
        row = rows[backend]
        assert "error" not in row, row.get("error")
        assert [s["step"] for s in row["per_step"]] == [1, 2, 3]
        for s in row["per_step"]:
            assert math.isfinite(s["loss"]) and s["grad_norm"] > 0 and s["step_s"] > 0 and s["peak_gib"] is None
            assert s["completion_len"] == 8 and s["reward_std"] > 0 and s["kl"] >= 0   # EOS silenced: full length
            assert s["forward_tokens"] > 0
        assert row["step_ms"] > 0 and row["timed_steps"] == 2 and row["rollout_tok_s"] > 0
        ends = [s["at_s"] for s in row["per_step"]]      # the soak's and the first step's figures
        assert ends == sorted(ends) and row["first_step_s"] > 0 and row["drift"]["window"] == 1
        assert all(s["gc_runs"] >= 0 and s["gc_max_s"] <= s["gc_s"] + 1e-9 for s in row["per_step"])
    assert rows["trl_generate"]["first_step_from"] == "backend start"      # after cb_sync, in the same process
    cb = rows["cb_sync"]
    assert cb["driver_alone_s"] > 0 and cb["driver_alone_same_tokens"] is True
    assert cb["rollout_vs_driver"] == round(cb["last_rollout_s"] / cb["driver_alone_s"], 3)


@pytest.mark.slow
def test_tiny_run_gate_and_logprob_gap(tiny_run):
    _, rows = tiny_run
    for backend in ("cb_sync", "trl_cb"):
        assert rows[backend]["gate"]["pass"] is True, rows[backend]["gate"]
    assert rows["trl_generate"]["gate_self"]["pass"] is True
    assert all(0.0 <= s["logp_gap_mean"] <= s["logp_gap_max"] < 1e-3 for s in rows["cb_sync"]["per_step"])
    assert rows["cb_sync"]["gate"]["checks"]["logp_gap"]["pass"] is True
    assert all("logp_gap_mean" not in s for s in rows["trl_generate"]["per_step"])


@pytest.mark.slow
def test_tiny_g2_eos_live(tmp_path):
    rows = {r["engine"]: r for r in grpo.main(["--tiny", "--workload", "G2", "--backends", "cb_sync", "trl_generate",
                                               "--out", str(tmp_path)])}
    for row in rows.values():
        assert "error" not in row, row.get("error")
        assert row["workload"] == "G2" and row["batch"] == 8 and row["stop_tokens"] == 53
        assert 64 <= row["prompt_len_min"] < row["prompt_len_max"] <= 512
        lengths = [n for s in row["per_step"] for n in s["completion_lens"]]
        assert len(lengths) == 16 and all(1 <= n <= 16 for n in lengths) and min(lengths) < 16   # EOS live
        assert row["len_count"] == 16 and row["len_max"] == max(lengths) and row["len_p50"] <= row["len_p90"]
    cb = rows["cb_sync"]
    assert cb["gate"]["pass"] is True, cb["gate"]
    assert cb["driver_alone_same_tokens"] is True      # sampled, EOS live: the repeat drew what the rollout drew
    table = (tmp_path / "grpo_g2.md").read_text()
    for text in ("# Workload G2", "2 prompts x 4 generations", "2 micro-batches of 4", "53 stop tokens",
                 "temperature 1.0, top_p 1.0, top_k 0, min_p None", "## Completion lengths"):
        assert text in table, text


@pytest.mark.slow
def test_synthetic_rollouts_give_every_run_the_same_completions(tmp_path):
    """The training half alone: grouped and TRL's micro-batches train on the same completions; TRL pads a whole
    rollout to one width, the grouped forwards have widths of their own, widened to WIDTH_MULTIPLE columns."""
    from cb_sync.integrations.trl.training.length_groups import WIDTH_MULTIPLE
    runs = [grpo.main(["--tiny", "--workload", "G2", "--backends", "cb_sync", "--synthetic-rollouts",
                       "--cb-group-by-length", group, "--name", group, "--out", str(tmp_path)])[0]
            for group in ("on", "off")]
    assert all("error" not in r and r["synthetic_rollouts"] for r in runs)
    lengths = [[s["completion_lens"] for s in r["per_step"]] for r in runs]
    assert lengths[0] == lengths[1] and len(lengths[0][0]) == 8
    assert runs[0]["cb_group_by_length"] and runs[1]["cb_group_by_length"] is False
    assert any(w % WIDTH_MULTIPLE == 0 for s in runs[0]["per_step"] for w in s["forward_widths"])
    assert all(len(s["forward_widths"]) == 1 for s in runs[1]["per_step"])


@pytest.mark.slow
def test_profile_step_writes_where_that_step_went(tmp_path):
    """--profile-step 2: a table of the second step's ops beside the results; the callback profiles that step alone,
    from its begin to its end."""
    from types import SimpleNamespace
    rows = grpo.main(["--tiny", "--backends", "cb_sync", "--steps", "2", "--profile-step", "2", "--name", "p",
                      "--out", str(tmp_path)])
    assert "error" not in rows[0] and len(rows[0]["per_step"]) == 2
    assert "Self CPU time total" in (tmp_path / "p_cb_sync_profile.txt").read_text()
    profile, x = grpo.StepProfile(2, tmp_path / "step.txt", cuda=False), torch.ones(8, 8)
    ops = [lambda: torch.cumsum(x, 0), lambda: torch.mm(x, x), lambda: torch.cumprod(x, 0)]
    for done, op in enumerate(ops):                  # steps 1, 2 and 3: the second one alone is profiled
        state = SimpleNamespace(global_step=done)
        profile.on_step_begin(None, state, None)
        op()
        profile.on_step_end(None, state, None)
    table = (tmp_path / "step.txt").read_text()
    assert "aten::mm" in table and "aten::cumsum" not in table and "aten::cumprod" not in table


@pytest.mark.slow
def test_ranks_train_replicas_that_stay_equal(tmp_path):
    """--ranks 1 2: the one-process run, then two ranks through accelerate launch (gloo on the CPU)."""
    rows = grpo.main(["--tiny", "--backends", "cb_sync", "--ranks", "1", "2", "--steps", "2", "--out", str(tmp_path)])
    assert [r["ranks"] for r in rows] == [1, 2] and all("error" not in r for r in rows), rows
    assert all(len(r["per_step"]) == 2 and r["completions_per_s"] > 0 for r in rows)
    assert rows[1]["replicas_equal"] is True and rows[1]["init_fingerprint"] == rows[0]["init_fingerprint"]
    assert "| cb_sync (2 ranks) | 2/2 |" in (tmp_path / "grpo_g.md").read_text()


def test_the_driver_alone_repeats_a_recorded_call():
    from cb_sync import SamplingParams, SyncCBDriver
    model = build_model(lora=True, tiny=True)
    calls, driver = grpo.DriverCalls(), SyncCBDriver(model)
    params = SamplingParams(max_new_tokens=6, do_sample=True, temperature=1.0)
    generate = SyncCBDriver.generate
    calls.on_train_begin(None, None, None, model=model)
    with calls.recording():
        driver.generate([[5, 6, 7], [8, 9]], params)
        driver.release(keep_graphs=True)
    assert SyncCBDriver.generate is generate and calls.release == {"keep_graphs": True}
    seconds, same = calls.driver_alone(model, cuda=False)
    assert same and len(seconds) == 2


def test_g2_settings_reach_trl(tmp_path):
    args = grpo.parse_args(["--tiny", "--workload", "G2", "--model", "qwen3-1.7b", "--out", str(tmp_path)])
    config = grpo.grpo_config(args, str(tmp_path))
    assert config.generation_batch_size == 8 and config.steps_per_generation == config.gradient_accumulation_steps == 2
    assert (config.temperature, config.top_p, config.top_k, config.min_p) == (1.0, 1.0, 0, None)
    assert config.max_completion_length == 16 and args.shots == (3, 28) and args.cb_max_batch_tokens == 2048
    assert args.backends[0] == "cb_sync" and args.name == "grpo_g2"
    full = grpo.parse_args(["--workload", "G2"])
    assert (full.work.rollout, full.work.micro_batch, full.max_completion, full.backends[0]) == (
        64, 16, 1024, "cb_sync_compiled")
    g = grpo.parse_args(["--tiny"])
    assert (g.workload, g.shots, g.max_completion, g.cb_max_batch_tokens, g.steps) == ("G", 6, 8, 512, 3)


def test_stop_tokens_give_the_target_mean():
    p = grpo.stop_probability(1024, 400)
    assert (1 - (1 - p) ** 1024) / p == pytest.approx(400, rel=1e-6)
    stops = grpo.stop_token_ids(151936, 1, 1024, 400)
    assert len(stops) == len(set(stops)) == 342 and stops[0] == 1 and max(stops) == 151935
    assert len(grpo.stop_token_ids(512, 1, 16, 8)) == 53
    tokenizer = make_tokenizer(512)
    prompts = list(grpo.make_dataset(n=128, shots=(3, 28), seed=0)["prompt"])
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    assert 64 <= min(lengths) and max(lengths) <= 512 and max(lengths) - min(lengths) > 300
    g_prompt = grpo.make_dataset(n=1, shots=6, seed=0)[0]["prompt"]            # Workload G's prompts
    assert len(tokenizer(g_prompt, add_special_tokens=False)["input_ids"]) == 130


def test_synthetic_completions_follow_the_workloads_law():
    tokenizer = make_tokenizer(512)
    stops = grpo.stop_token_ids(512, tokenizer.eos_token_id, 16, 8)
    draw = grpo.SyntheticRollouts(grpo.WORKLOADS["G2"][1], 16, tokenizer, stops, seed=0)
    completions, logprobs = draw([[1, 2]] * 200)
    assert completions == grpo.SyntheticRollouts(grpo.WORKLOADS["G2"][1], 16, tokenizer, stops, seed=0)(
        [[1, 2]] * 200)[0]                                                # one seeded stream: the same every run
    assert all(len(c) == len(lp) and 1 <= len(c) <= 16 for c, lp in zip(completions, logprobs))
    assert all(c[-1] == tokenizer.eos_token_id for c in completions if len(c) < 16)
    assert 6 < sum(map(len, completions)) / len(completions) < 10               # mean 8
    assert all(t not in stops for c in completions for t in c[:-1])


def test_compare_flags_failures():
    ref = [{"step": i, "loss": 0.1, "reward": 1.0, "reward_std": 0.5, "kl": 0.01, "grad_norm": 1.0} for i in (1, 2)]
    assert compare(ref, [{**r, "kl": 0.012} for r in ref], 1e-3, reward_range=(-1, 2), kl_rtol=0.5)["pass"] is True
    assert compare(ref, [{**ref[0], "loss": float("nan")}, ref[1]], 1e-3)["checks"]["losses_finite"]["pass"] is False
    out_of_range = [{**r, "reward": 5.0} for r in ref]
    assert compare(ref, out_of_range, 1e-3, reward_range=(-1, 2))["checks"]["rewards_in_range"]["pass"] is False
    result = compare(ref, [{**r, "kl": 0.5} for r in ref], 1e-3, kl_rtol=0.5)
    assert result["pass"] is False and result["checks"]["kl_close"]["max_abs_diff"] == pytest.approx(0.49)
    assert compare(ref, ref[:1], 1e-3)["checks"]["steps"]["pass"] is False
    assert compare(ref[:1], ref, 1e-3, expected_steps=2)["checks"]["steps"]["pass"] is True
    flat = [{**r, "reward_std": 0.0, "grad_norm": 0.0} for r in ref]       # zero advantages: nothing learnt
    assert compare(ref, flat, 1e-3)["checks"]["signal"]["pass"] is False
    no_kl = [{k: v for k, v in r.items() if k != "kl"} for r in ref]
    assert compare(no_kl, no_kl, 1e-3)["checks"]["kl_close"]["pass"] is None
