"""lora_input_casts: PEFT's LoRA input cast skipped where autocast undoes it, with nothing changed but the copies."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from cb_sync.integrations.trl.training import lora_input_casts
from cb_sync.integrations.trl.training.lora_input_casts import input_casts, round_trip_layers
from conftest import make_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_qwen3(dropout: float = 0.0, **config):
    torch.manual_seed(0)
    model = make_model("qwen3").to(torch.bfloat16)
    return get_peft_model(model, LoraConfig(r=8, target_modules=TARGETS, lora_dropout=dropout,
                                            init_lora_weights=False, **config))


def test_only_plain_lora_layers_without_dropout_and_settings_restored_when_nested():
    model = _lora_qwen3()
    layers = round_trip_layers(model)
    assert len(layers) == len(TARGETS) * model.config.num_hidden_layers
    assert round_trip_layers(_lora_qwen3(dropout=0.1)) == []
    assert round_trip_layers(_lora_qwen3(use_dora=True)) == []
    with input_casts(model, enabled=False):
        assert not any(layer.cast_input_dtype_enabled for layer in layers)
        with input_casts(model, enabled=True):
            assert all(layer.cast_input_dtype_enabled for layer in layers)
        assert not any(layer.cast_input_dtype_enabled for layer in layers)
    assert all(layer.cast_input_dtype_enabled for layer in layers)


def test_skipping_the_cast_under_autocast_changes_no_bit_of_logits_or_gradients():
    """bf16 weights, fp32 adapters, bf16 autocast, gradient checkpointing, left padding: the same logits and the same
    gradient in every adapter weight, bit for bit, with PEFT's cast and without."""
    model = _lora_qwen3()
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))
    ids = torch.randint(3, model.config.vocab_size, (3, 40), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0

    def run(cast: bool):
        model.zero_grad(set_to_none=True)
        with input_casts(model, cast), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logits.float().logsumexp(-1).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (kept_logits, kept_grads), (skipped_logits, skipped_grads) = run(True), run(False)
    assert torch.equal(kept_logits, skipped_logits)
    assert kept_grads.keys() == skipped_grads.keys() and len(kept_grads) == 2 * len(round_trip_layers(model))
    assert all(torch.equal(kept_grads[name], skipped_grads[name]) for name in kept_grads)


def test_trainer_skips_the_cast_in_its_forwards_keeps_it_in_rollouts_and_trains_the_same(tmp_path, monkeypatch):
    """CBSyncGRPOTrainer with bf16 mixed precision on the CPU: its logprob forwards run without the cast, its rollouts
    with it, every layer's setting is restored after training, and the trained weights equal, bit for bit, those of a
    run that keeps the cast."""
    from trl import GRPOTrainer

    from cb_sync import CBConfig, SyncCBDriver
    from cb_sync.integrations.trl import CBSyncGRPOTrainer
    from test_integration_trl import dataset, even_fraction, grpo_args, tokenizer, tiny_model

    seen = {"forward": set(), "rollout": set()}
    trl_forward, generate = GRPOTrainer._get_per_token_logps_and_entropies, SyncCBDriver.generate

    def recording_forward(self, model, *args, **kwargs):
        seen["forward"].update(layer.cast_input_dtype_enabled for layer in round_trip_layers(model))
        return trl_forward(self, model, *args, **kwargs)

    def recording_generate(driver, *args, **kwargs):
        seen["rollout"].update(layer.cast_input_dtype_enabled for layer in round_trip_layers(driver.model))
        return generate(driver, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", recording_forward)
    monkeypatch.setattr(SyncCBDriver, "generate", recording_generate)

    def train() -> dict:
        model = tiny_model().to(torch.bfloat16)
        trainer = CBSyncGRPOTrainer(model=model, reward_funcs=even_fraction,
                                    args=grpo_args(tmp_path, max_steps=2, bf16=True, beta=0.1),
                                    train_dataset=dataset(), processing_class=tokenizer(),
                                    cb_config=CBConfig(block_size=4, max_batch_tokens=64),
                                    peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
        trainer.train()
        layers = round_trip_layers(trainer.model)
        assert layers and all(layer.cast_input_dtype_enabled for layer in layers)
        return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

    skipped = train()
    assert seen == {"forward": {False}, "rollout": {True}}
    monkeypatch.setattr(lora_input_casts, "round_trip_layers", lambda model: [])
    kept = train()
    assert all(torch.equal(skipped[k], kept[k]) for k in kept)


def test_trainer_leaves_peft_settings_alone_without_mixed_precision(tmp_path):
    """In full precision no forward runs under autocast, so the trainer neither skips the cast nor restores it: a
    setting of the user's own stays as it is through a training step's context and a rollout's."""
    from cb_sync import CBConfig
    from cb_sync.integrations.trl import CBSyncGRPOTrainer
    from test_integration_trl import dataset, even_fraction, grpo_args, tokenizer, tiny_model

    trainer = CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction, args=grpo_args(tmp_path, max_steps=1),
                                train_dataset=dataset(), processing_class=tokenizer(),
                                cb_config=CBConfig(block_size=4, max_batch_tokens=64),
                                peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    layers = round_trip_layers(trainer.model)
    layers[0].cast_input_dtype_enabled = False
    for enabled in (False, True):
        with trainer._forwards(trainer.model, training=not enabled):
            assert [layer.cast_input_dtype_enabled for layer in layers] == [False] + [True] * (len(layers) - 1)
