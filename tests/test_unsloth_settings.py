"""The GRPO benchmark's `unsloth` backend trains with the settings of every other backend, without Unsloth installed:
a stand-in for Unsloth's patched GRPOConfig (its defaults, from unsloth/models/rl.py of Unsloth 2026.10.9) receives
what the backend passes, and every field comes out as the cb_sync backend's."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

import trl  # noqa: E402

from benchmarks import grpo, peers  # noqa: E402

# What Unsloth's patched GRPOConfig defaults to where a field is not given (None: resolved in its __init__)
UNSLOTH_DEFAULTS = dict(
    logging_nan_inf_filter=False, per_device_train_batch_size=4, gradient_accumulation_steps=2, weight_decay=0.001,
    seed=3407, optim="adamw_8bit", learning_rate=5e-5, per_device_eval_batch_size=4, eval_accumulation_steps=2,
    torch_empty_cache_steps=250, logging_steps=1, num_generations=8, vllm_mode="colocate", generation_kwargs={},
    bf16=False, fp16=False, report_to="none", include_num_input_tokens_seen=False, auto_find_batch_size=False,
    dataloader_pin_memory=True, warmup_steps=0.1, loss_type=None, beta=None, vllm_importance_sampling_correction=False,
    router_aux_loss_coef=0.0, mask_truncated_completions=None)
MOE_ONLY = "router_aux_loss_coef"       # weighs an MoE loss; TRL resolves its None to 0.0 on a dense model


def unsloth_like_config():
    """trl.GRPOConfig with Unsloth's defaults for what is not given, and its resolution of loss_type, beta and (for
    an explicit loss_type "dapo") the DAPO paper's mask_truncated_completions and epsilon_high."""
    class UnslothGRPOConfig(trl.GRPOConfig):
        def __init__(self, **given):
            fields = {**UNSLOTH_DEFAULTS, **given}
            explicit_dapo = given.get("loss_type") == "dapo"
            fields["loss_type"] = fields["loss_type"] or "dapo"
            if fields["beta"] is None:
                fields["beta"] = 0.0 if fields["loss_type"] in ("dapo", "dr_grpo") else 0.001
            if explicit_dapo and fields["mask_truncated_completions"] is None:
                fields["mask_truncated_completions"] = True
            if explicit_dapo and fields.get("epsilon_high") is None:
                fields["epsilon_high"] = 0.28
            fields["mask_truncated_completions"] = bool(fields["mask_truncated_completions"])
            super().__init__(**fields)
    return UnslothGRPOConfig


@pytest.mark.parametrize("workload", ["G", "G2"])
def test_unsloth_gets_every_setting_of_the_cb_sync_backend(tmp_path, monkeypatch, workload):
    args = grpo.parse_args(["--tiny", "--workload", workload])
    cb_sync = grpo.grpo_config(args, str(tmp_path)).to_dict()          # what cb_trainer passes
    monkeypatch.setattr(trl, "GRPOConfig", unsloth_like_config())     # as after `import unsloth`
    bare = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True).to_dict()
    assert {k for k in UNSLOTH_DEFAULTS if bare[k] != cb_sync[k]} >= {"optim", "weight_decay", "seed", "learning_rate",
                                                                       "warmup_steps", "num_generations", "beta"}
    unsloth = peers.peer_config("unsloth", args, grpo.grpo_config, str(tmp_path), stops=None)
    assert type(unsloth).__name__ == "UnslothGRPOConfig"
    got = unsloth.to_dict()
    assert {k: (got[k], v) for k, v in cb_sync.items() if k != MOE_ONLY and got[k] != v} == {}
    assert (got[MOE_ONLY] or 0.0) == (cb_sync[MOE_ONLY] or 0.0) == 0.0


def test_the_settings_given_explicitly_are_trls_defaults():
    """Given explicitly (Unsloth's patched config has others), TRL's own defaults; epsilon_high 0.2 is what TRL's
    None means (epsilon), and {} adds to the generation config what None does: nothing."""
    fields = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}

    def default(name):
        field = fields[name]
        return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
    same = {"epsilon_high": default("epsilon"), "generation_kwargs": {}}
    given = {**grpo.TRL_DEFAULTS, **grpo.TRL_SAMPLING}
    assert {k: (v, default(k)) for k, v in given.items() if same.get(k, default(k)) != v} == {}
    assert default("epsilon_high") is None and default("generation_kwargs") is None
