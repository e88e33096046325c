"""attention_warmup: the attention calls a warm-up makes, what it leaves untouched, and when the trainer's hook runs it."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from cb_sync.integrations import attention_warmup
from cb_sync.integrations.attention_warmup import WARM_LENGTHS, AttentionWarmup, wants_warmup, warm_attention
from conftest import make_model


def _lora_qwen3_in_training():
    model = make_model("qwen3")
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["q_proj", "v_proj"]))
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


@pytest.fixture
def sdpa_calls(monkeypatch):
    """(length, masked, "forward" with or without gradients / "backward") of every SDPA call, in order."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, *args, **kwargs):
        out = sdpa(query, key, value, attn_mask, *args, **kwargs)
        masked = attn_mask is not None
        calls.append((query.shape[2], masked, "grad" if query.requires_grad else "no_grad"))
        if query.requires_grad:
            out.register_hook(lambda grad: calls.append((query.shape[2], masked, "backward")))
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return calls


@pytest.mark.parametrize("grad, masked", [(False, False), (False, True), (True, False), (True, True)])
def test_warm_attention_runs_its_variety_at_each_length_and_changes_nothing(sdpa_calls, grad, masked):
    model = _lora_qwen3_in_training()
    rng = torch.get_rng_state()
    warm_attention(model, token_id=3, grad=grad, masked=masked)

    assert torch.equal(torch.get_rng_state(), rng)        # LoRA dropout ran, in a forked random state
    assert model.training
    assert all(p.grad is None for p in model.parameters())
    kinds = {"grad", "backward"} if grad else {"no_grad"}
    assert set(sdpa_calls) == {(length, masked, kind) for length in WARM_LENGTHS for kind in kinds}


def test_before_forward_warms_each_variety_once(sdpa_calls, monkeypatch):
    model = _lora_qwen3_in_training()
    monkeypatch.setattr(attention_warmup, "wants_warmup", lambda module: True)
    warmup = AttentionWarmup(token_id=3)
    with torch.no_grad():
        assert warmup.pending()
        warmup.before_forward(model, masked=False)
        assert sdpa_calls == [(n, False, "no_grad") for n in WARM_LENGTHS for _ in range(2)]     # two layers
        sdpa_calls.clear()
        warmup.before_forward(model, masked=False)
        assert sdpa_calls == [] and warmup.pending()                              # once a variety
        warmup.before_forward(model, masked=True)
        assert not warmup.pending()
    with torch.enable_grad():
        assert warmup.pending()
        warmup.before_forward(model, masked=True)
    assert {c[1:] for c in sdpa_calls if c[2] != "no_grad"} == {(True, "grad"), (True, "backward")}
    assert warmup.seen == {(False, False), (False, True), (True, True)}


def test_before_forward_leaves_other_attention_alone(sdpa_calls):
    warmup = AttentionWarmup(token_id=3)
    warmup.before_forward(_lora_qwen3_in_training(), masked=True)           # on the CPU: nothing to build
    assert sdpa_calls == [] and warmup.seen == {(torch.is_grad_enabled(), True)}


def test_wants_warmup_only_for_sdpa_on_cuda():
    assert not wants_warmup(make_model("qwen3"))            # on the CPU
    assert not wants_warmup(make_model("gemma2"))           # eager attention


def test_trainer_warms_each_variety_at_its_first_forward_and_trains_the_same(tmp_path, monkeypatch):
    from cb_sync import CBConfig
    from cb_sync.integrations import trl as cb_trl
    from test_integration_trl import dataset, even_fraction, grpo_args, tiny_model, tokenizer

    def train(warm: bool) -> tuple[dict, list]:
        events = []
        monkeypatch.setattr(attention_warmup, "wants_warmup", lambda model: warm)
        monkeypatch.setattr(attention_warmup, "warm_attention",
                            lambda *a, **k: (events.append(("warm", k["grad"], k["masked"])), warm_attention(*a, **k)))
        model = tiny_model()
        trainer = cb_trl.CBSyncGRPOTrainer(model=model, reward_funcs=even_fraction, args=grpo_args(tmp_path, max_steps=2),
                                           train_dataset=dataset(), processing_class=tokenizer(),
                                           cb_config=CBConfig(block_size=4, max_batch_tokens=64))
        rollout = trainer._generate_single_turn
        trainer._generate_single_turn = lambda *a, **k: (events.append("rollout"), rollout(*a, **k))[1]
        trainer.train()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, events

    warmed, events = train(True)
    plain, plain_events = train(False)
    assert plain_events == ["rollout", "rollout"]
    warms = [e for e in events if e != "rollout"]
    assert events[0] == "rollout" and len(warms) == len(set(warms)) and ("warm", True, True) in warms
    assert events.index(("warm", True, True)) < events.index("rollout", 1)     # in the first step
    assert all(torch.equal(warmed[k], plain[k]) for k in plain)


@pytest.mark.gpu
def test_warm_attention_on_cuda_under_autocast():
    model = _lora_qwen3_in_training().to("cuda")
    assert wants_warmup(model)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for grad in (False, True):
            warm_attention(model, token_id=3, grad=grad, masked=True)
    assert all(p.grad is None for p in model.parameters())
