"""The benchmarks' peers where their packages are absent: vLLM's engine arguments and rows, Workload T's ratios,
rows of engines run in processes of their own (and of those that could not run), the process-group cleanup, TRL +
vLLM's GRPOConfig, the GRPO rows that say why a peer did not run or what it wrote, the weight-sync verdict and the
gate's "trained" check."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch

from benchmarks import harness, peers, throughput
from benchmarks.grpo_stats import GRPOStats, compare, gate_lines, summary_table

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_trl = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("trl", "datasets")),
                               reason="needs trl and datasets")


# -- vLLM for Workloads T and L -----------------------------------------------------------------------------------

def test_llm_kwargs_follow_the_setup_that_ran():
    lora = peers.llm_kwargs("/m", lora=True)
    assert lora == dict(model="/m", load_format="dummy", dtype="bfloat16", max_model_len=1024,
                        gpu_memory_utilization=0.8, skip_tokenizer_init=True, enable_lora=True, max_lora_rank=32,
                        max_loras=1)
    plain = peers.llm_kwargs("/m", lora=False, gpu_memory_utilization=0.5)
    assert "enable_lora" not in plain and plain["gpu_memory_utilization"] == 0.5
    assert peers.sampling_kwargs(256) == dict(max_tokens=256, temperature=0.0, ignore_eos=True, detokenize=False)
    assert peers.sampling_kwargs(8, "grpo")["temperature"] == 1.0


def test_engine_inputs_are_a_config_and_a_peft_adapter(tmp_path):
    model_dir, adapter_dir, vocab = peers.write_engine_inputs(tmp_path, lora=True, tiny=True)
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["vocab_size"] == vocab == 512
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 32 and adapter["lora_alpha"] == 64 and len(adapter["target_modules"]) == 7
    from safetensors import safe_open
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        b = f.get_tensor(next(k for k in keys if "lora_B" in k))
    assert len(keys) == 2 * 7 * 2 and b.abs().max() > 0          # 2 layers x 7 projections x (A, B); B not zero
    assert peers.write_engine_inputs(tmp_path / "plain", lora=False, tiny=True)[1] is None


def test_card_fields_hold_and_reserve():
    fields = peers.card_fields((1.5, 140.0), (117.7, 140.0), 0.8)
    assert fields["card_held_gib"] == fields["peak_gib"] == 116.2 and fields["card_reserved_gib"] == 112.0
    assert peers.card_fields(None, None, 0.8) == {"peak_gib": None}


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed")
def test_vllm_engine_without_vllm_gives_rows_with_the_error(tmp_path):
    rows = peers.vllm_main(["--engine", "vllm", "--batches", "4", "32", "--tiny", "--out", str(tmp_path)])
    assert [(r["batch"], r["lora"], r["workload"]) for r in rows] == [(4, True, "T"), (32, True, "T")]
    assert all(r["error"].startswith("vllm could not be imported: ModuleNotFoundError") for r in rows)
    assert "could not run: vllm could not be imported" in (tmp_path / "vllm_T.md").read_text()


# -- Workload T's table and engines in processes of their own -----------------------------------------------------

def _row(engine, lora, tok_s, batch=4, **extra):
    return {"engine": engine, "lora": lora, "batch": batch, "tok_per_s": tok_s, "peak_gib": 10.0,
            "pct_of_floor": 40.0, **extra}


def test_table_ratios_to_vllm_with_and_without_lora():
    rows = [_row("cb_sync_compiled", True, 1000.0), _row("cb_sync_compiled", False, 1100.0),
            _row("vllm", True, 733.0, card_held_gib=116.2, card_reserved_gib=112.0, engine_start_s=120.5),
            _row("vllm_nolora", False, 1075.0), _row("hf_generate", True, 100.0),
            {"engine": "vllm", "lora": True, "batch": 32, "error": "engine start failed: OOM"}]
    lines = throughput.table(rows).splitlines()[2:]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0][-1] == "1.36x vllm, 0.93x vllm_nolora, 10.0x hf_generate"
    assert cells[1][-1] == "1.02x vllm_nolora"                      # no adapter: vllm (LoRA) is no peer of it
    assert cells[2][5] == "116.2 / 112.0" and cells[2][8] == "120.5" and cells[2][-1] == "-"   # peers: no ratio
    assert cells[3][-1] == "-" and cells[4][-1] == "-"
    assert cells[5][2] == "32" and cells[5][-1] == "could not run: engine start failed: OOM"


def test_tables_of_several_runs_merge_and_keep_their_card(tmp_path):
    stamp = {"card": "NVIDIA H200", "timestamp": "2026-12-03T10:00:00+00:00", "commit": "abc1234"}
    (tmp_path / "a.json").write_text(json.dumps([_row("cb_sync_compiled", True, 1000.0, **stamp)]))
    (tmp_path / "b.json").write_text(json.dumps([_row("vllm", True, 800.0, **stamp)]))
    throughput.main(["--from-json", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--name", "m", "--out",
                     str(tmp_path)])
    assert [r["engine"] for r in json.loads((tmp_path / "m.json").read_text())] == ["cb_sync_compiled", "vllm"]
    text = (tmp_path / "m.md").read_text()
    assert "1.25x vllm" in text and "Card: NVIDIA H200; date: 2026-12-03; commit: abc1234." in text


def test_vllm_engines_need_isolate():
    with pytest.raises(SystemExit) as info:
        throughput.main(["--engines", "vllm", "--tiny"])
    assert info.value.code == 2


def _child(script: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(script)]


def _expected(engine):
    return [{"engine": engine, "lora": True, "batch": batch} for batch in (4, 32)]


def test_engines_rows_are_merged_and_missing_rows_say_why(tmp_path):
    scripts = {
        # writes batch 4 only, prints the failure of batch 32 as the benchmarks do
        "cb_sync": f"""
            import json
            json.dump([{{"engine": "cb_sync", "lora": True, "batch": 4, "tok_per_s": 900.0}}],
                      open({str(tmp_path / 'tp_cb_sync.json')!r}, "w"))
            print("cb_sync batch 32 failed: RuntimeError('boom')")""",
        # writes its own error rows (as a vLLM engine does)
        "vllm": f"""
            import json
            json.dump([{{"engine": "vllm", "lora": True, "batch": b, "error": "engine start failed: X"}}
                       for b in (4, 32)], open({str(tmp_path / 'tp_vllm.json')!r}, "w"))""",
        "vllm_nolora": "import sys; print('fatal: no card'); sys.exit(3)",     # dies without writing anything
    }
    merged = []
    rows = harness.run_engines(list(scripts), lambda engine, part, left: _child(scripts[engine]), _expected,
                               tmp_path, "tp", None, merged.append)
    assert [(r["engine"], r["batch"]) for r in rows] == [("cb_sync", 4), ("cb_sync", 32), ("vllm", 4), ("vllm", 32),
                                                         ("vllm_nolora", 4), ("vllm_nolora", 32)]
    assert all(r["process"] == "own" for r in rows) and len(merged) == 3
    assert rows[0]["tok_per_s"] == 900.0 and rows[1]["error"] == "cb_sync batch 32 failed: RuntimeError('boom')"
    assert rows[2]["error"] == "engine start failed: X"
    assert "exited with code 3" in rows[4]["error"] and "fatal: no card" in rows[4]["error"]
    assert not list(tmp_path.iterdir())                     # the engines' own files are removed


def test_a_time_limit_stops_an_engine_and_skips_the_rest(tmp_path):
    start = time.monotonic()
    rows = harness.run_engines(["cb_sync", "vllm"], lambda *a: _child("import time; time.sleep(60)"), _expected,
                               tmp_path, "tp", 1.5)
    assert time.monotonic() - start < 30
    assert "stopped at its time limit" in rows[0]["error"] and rows[0]["engine"] == "cb_sync"
    assert rows[2]["engine"] == "vllm" and rows[2]["error"] == "not run: the run's --time-limit was used up"


def test_run_child_interrupts_a_child_when_this_process_ignores_sigint():
    """A shell that starts the benchmark in the background ignores SIGINT, and children inherit that: the child still
    gets SIGINT as an interruption at its time limit, not the termination 30 s later."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        outcome = harness.run_child(_child("""
            import time
            try:
                time.sleep(60)
            except KeyboardInterrupt:
                print("interrupted")"""), timeout=1.0)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert outcome.timed_out and "interrupted" in outcome.tail


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_run_child_ends_what_the_child_left_running(tmp_path):
    pid_file = tmp_path / "pid"
    outcome = harness.run_child(_child(f"""
        import subprocess, sys
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pid_file)!r}, "w").write(str(worker.pid))
        print("started")"""))
    assert outcome.returncode == 0 and outcome.tail == ["started"] and not outcome.timed_out
    pid = int(pid_file.read_text())
    for _ in range(50):
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid)


# -- GRPO: TRL + vLLM and Unsloth ---------------------------------------------------------------------------------

@needs_trl
def test_trl_vllm_config_keeps_trl_defaults(tmp_path):
    from benchmarks import grpo
    args = grpo.parse_args(["--tiny"])
    config = grpo.grpo_config(args, str(tmp_path), **peers.trl_vllm_kwargs(sleep=False))
    assert config.use_vllm and config.vllm_mode == "colocate" and not config.vllm_enable_sleep_mode
    assert config.model_init_kwargs == {"dtype": torch.bfloat16}
    assert config.vllm_importance_sampling_correction and config.vllm_gpu_memory_utilization == 0.3
    assert config.temperature == 0.1 and config.num_generations == 4 and config.top_k == 5
    assert (config.optim, config.weight_decay) == ("adamw_torch_fused", 0.0)     # set for Unsloth's patched config
    assert peers.trl_vllm_kwargs(sleep=True)["vllm_enable_sleep_mode"] is True
    stops = [1, 500, 511]
    assert peers.trl_vllm_kwargs(False, stops)["generation_kwargs"] == {"stop_token_ids": stops}
    env = peers.distributed_env()
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}


@needs_trl
def test_peers_that_cannot_run_say_why(tmp_path):
    from benchmarks import grpo
    site = tmp_path / "usite"
    rows = {r["engine"]: r for r in grpo.main(["--tiny", "--backends", "trl_vllm", "trl_vllm_sleep", "unsloth",
                                                "--unsloth-site", str(site), "--out", str(tmp_path)])}
    if not HAS_VLLM:
        assert rows["trl_vllm"]["skipped"] == rows["trl_vllm_sleep"]["skipped"] == (
            "vllm is not installed (no module named 'vllm' on this Python path)")
    assert str(site) in rows["unsloth"]["skipped"] and "holds no unsloth package" in rows["unsloth"]["skipped"]
    assert all(r["skipped"] in (tmp_path / "grpo_g.md").read_text() for r in rows.values())
    (site / "unsloth").mkdir(parents=True)
    (site / "unsloth" / "__init__.py").write_text("")
    args = grpo.parse_args(["--tiny", "--unsloth-site", str(site)])
    assert "needs a CUDA device" in peers.skip_reason("unsloth", args)


@needs_trl
def test_child_commands_carry_the_runs_settings(tmp_path):
    from benchmarks import grpo
    args = grpo.parse_args(["--workload", "G2", "--model", "qwen3-1.7b", "--steps", "8", "--sdpa-cudnn", "off",
                            "--out", str(tmp_path), "--unsloth-site", "/x/usite", "--synthetic-rollouts"])
    argv = grpo.child_argv(args, "trl_vllm_sleep", 123.4)
    child = grpo.parse_args(argv)
    assert (child.backends, child.workload, child.model, child.shots, child.steps, child.time_limit) == (
        ["trl_vllm_sleep"], "G2", "qwen3-1.7b", (3, 28), 8, 123.0)
    assert child.sdpa_cudnn == "off" and child.synthetic_rollouts and child.unsloth_site == "/x/usite"
    command = peers.child_command("unsloth", argv, tmp_path / "r.json")
    assert command[1:4] == ["-m", "benchmarks.peers", "unsloth"] and command[-2:] == ["--row-file",
                                                                                      str(tmp_path / "r.json")]
    assert peers.child_command("trl_vllm", argv, tmp_path / "r.json")[1:3] == ["-m", "benchmarks.grpo"]
    env = peers.child_env("unsloth", args)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == "/x/usite" and env["HF_HUB_OFFLINE"] == "1"
    assert peers.child_env("trl_vllm", args) == dict(os.environ)


def test_own_process_rows_are_merged(tmp_path, monkeypatch):
    args = SimpleNamespace(out=tmp_path, name="grpo", unsloth_site="/x")
    steps = [{"step": 1, "step_s": 3.0, "gen_s": 1.0, "loss": 0.0, "grad_norm": 0.0}]
    scripts = {
        "trl_vllm": f"""
            import json
            json.dump({{"engine": "trl_vllm", "per_step": {steps!r}, "build_s": 80.0,
                       "weight_sync": {{"reaches": True}}}},
                      open({str(tmp_path / 'grpo_trl_vllm.row.json')!r}, "w"))""",
        "unsloth": f"""
            import json, sys
            json.dump({{"backend": "unsloth", "build_s": 20.0, "steps": {steps!r}}},
                      open({str(tmp_path / 'grpo_unsloth.json')!r}, "w"))
            print("CUDA error: out of memory"); sys.exit(3)""",
    }
    monkeypatch.setattr(peers, "child_command", lambda backend, *a: _child(scripts[backend]))
    rows = {b: {"engine": b} for b in scripts}
    for backend, row in rows.items():
        peers.run_grpo_peer(backend, ["--time-limit", "30"], args, row)
    assert rows["trl_vllm"]["per_step"] == steps and rows["trl_vllm"]["weight_sync"] == {"reaches": True}
    assert "error" not in rows["trl_vllm"] and not (tmp_path / "grpo_trl_vllm.row.json").exists()
    assert rows["unsloth"]["per_step"] == steps and rows["unsloth"]["build_s"] == 20.0
    assert "exited with code 3" in rows["unsloth"]["error"] and "out of memory" in rows["unsloth"]["error"]
    assert all(r["process"] == "own" for r in rows.values())


def test_weight_sync_verdict():
    torch.manual_seed(0)
    start = torch.randn(64, 64).to(torch.bfloat16)
    delta = torch.randn(64, 64) * 1e-2
    merged = start.clone()
    merged += delta
    reached = peers.sync_verdict("w", merged, merged, start, start, delta, before=start)
    assert reached["reaches"] is True and reached["mismatch_vs_trainer"] == 0
    assert reached["changed_vs_start"] == reached["expected_changed"] == reached["changed_by_last_sync"] > 0
    stale = peers.sync_verdict("w", start, merged, start, start, delta)
    assert stale["reaches"] is False and stale["mismatch_vs_trainer"] == stale["expected_changed"]
    assert peers.sync_verdict("w", start, start, start, start, delta * 0)["reaches"] is None


def test_checkpoint_tensor_reads_a_saved_model(tmp_path):
    model = harness.build_model(lora=False, tiny=True)
    path = peers.save_model(model, harness.make_tokenizer(512), tmp_path / "m")
    name = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(peers.checkpoint_tensor(path, name), model.get_parameter(name))
    assert (tmp_path / "m" / "tokenizer.json").is_file()


@pytest.mark.skipif(importlib.util.find_spec("unsloth") is not None, reason="unsloth is installed")
def test_unsloth_trainer_without_unsloth_raises_its_import_error():
    with pytest.raises(RuntimeError, match="unsloth could not be imported: ModuleNotFoundError"):
        peers.unsloth_trainer(None, None, "/m", [], [], None, [], None)


@needs_trl
def test_grpo_runs_of_several_calls_merge_and_gate_together(tmp_path):
    from benchmarks import grpo
    base = {**grpo.settings(grpo.parse_args([]), harness.make_tokenizer(151936), grpo.make_dataset(n=2)),
            "steps": 3, "card": "NVIDIA H200", "timestamp": "2026-12-03T10:00:00+00:00"}
    masked = _steps(3, loss=0.0, grad_norm=0.0, is_ratio_max=0.0)
    first = [{"engine": "cb_sync_compiled", **base, "per_step": _steps(3)},
             {"engine": "trl_vllm", **base, "skipped": "vllm is not installed"}]
    second = [{"engine": "trl_vllm", **base, "per_step": masked}]
    for name, rows in (("a", first), ("b", second)):
        (tmp_path / f"{name}.json").write_text(json.dumps(rows))
    rows = {r["engine"]: r for r in grpo.main(["--from-json", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                                               "--name", "m", "--out", str(tmp_path)])}
    assert rows["trl_vllm"]["per_step"] == masked and "skipped" not in rows["trl_vllm"]
    assert rows["trl_vllm"]["gate_self"]["checks"]["trained"]["pass"] is False
    assert rows["cb_sync_compiled"]["gate_self"]["pass"] is True
    text = (tmp_path / "m.md").read_text()
    assert "# Workload G (GRPO)" in text and "Card: NVIDIA H200; date: 2026-12-03" in text


# -- GRPO stats and gate ------------------------------------------------------------------------------------------

def test_stats_log_is_ratio_and_logprob_gap():
    stats = GRPOStats("trl_vllm", verbose=False, cuda=False)
    state = SimpleNamespace(global_step=1, max_steps=2)
    stats.on_step_begin(None, state, None)
    stats.on_step_end(None, state, SimpleNamespace(should_training_stop=False))
    stats.on_log(None, state, None, logs={"loss": 0.0, "grad_norm": 0.0, "sampling/sampling_logp_difference/mean": 0.34,
                                          "sampling/sampling_logp_difference/max": 2.0,
                                          "sampling/importance_sampling_ratio/min": 0.0,
                                          "sampling/importance_sampling_ratio/mean": 0.0,
                                          "sampling/importance_sampling_ratio/max": 0.0})
    row = stats.rows[0]
    assert (row["logp_gap_mean"], row["logp_gap_max"], row["is_ratio_max"]) == (0.34, 2.0, 0.0)
    assert row["card_gib"] is None and stats.sampled(lambda x: x + 1)(1) == 2


def _steps(n, **values):
    base = {"loss": 0.1, "reward": 1.0, "reward_std": 0.5, "kl": 0.01, "grad_norm": 1.0}
    return [{"step": i, "step_s": 3.0, "gen_s": 1.0, "peak_gib": 9.0, **base, **values} for i in range(1, n + 1)]


def test_gate_flags_a_backend_that_trained_nothing():
    ref = _steps(3)
    masked = _steps(3, loss=0.0, grad_norm=0.0, is_ratio_max=0.0, is_ratio_mean=0.0, is_ratio_min=0.0)
    gate = compare(ref, masked, 1e-3, reward_range=(-3, 11), kl_rtol=1.0)
    trained = gate["checks"]["trained"]
    assert gate["pass"] is False and trained["pass"] is False and trained["masked_by_is"] is True
    assert trained["idle_steps"] == 3
    assert compare(ref, ref, 1e-3)["checks"]["trained"]["pass"] is True
    assert compare(ref, masked[:2] + ref[2:], 1e-3)["checks"]["trained"]["pass"] is True
    assert compare(ref, _steps(3, loss=0.0, grad_norm=0.0), 1e-3)["checks"]["trained"]["masked_by_is"] is False
    row = {"engine": "trl_vllm", "per_step": masked, "steps": 3, "step_ms": 3000.0, "gen_ms": 1000.0,
           "peak_gib": 9.0, "card_gib": 52.0, "mean_completion_len": 512.0, "gate": gate, "logp_gap_mean": 0.34,
           "logp_gap_max": 2.0, "is_ratio_mean": 0.0, "is_ratio_min": 0.0}
    assert "FAIL (trained nothing: IS correction masked every sequence)" in summary_table([row])
    assert "trained FAIL (loss and grad norm 0 on 3 of 3 steps: trained nothing; IS ratio max 0" in gate_lines([row])[0]
