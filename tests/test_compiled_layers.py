"""training_step_compile: the trained model's decoder layers compiled for a training step, eager for its rollouts."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from torch._dynamo.utils import counters

from cb_sync import CBConfig, SyncCBDriver
from cb_sync.integrations.trl.training.training_step_compile import CompiledLayers, decoder_layers
from conftest import make_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_decoder_layers_are_found_and_switched_layers_restored_when_nested_and_on_error():
    model = make_model("qwen3")
    layers = decoder_layers(model)
    assert layers == list(model.model.layers) and decoder_layers(torch.nn.Linear(2, 2)) == []
    compiled = CompiledLayers()
    with compiled.switched(model, True):
        calls = [layer._compiled_call_impl for layer in layers]
        # one compiled function, given each layer as its module
        assert [(call.func, call.args) for call in calls] == [(compiled._compiled_call, (layer,)) for layer in layers]
        with compiled.switched(model, False):
            assert all(layer._compiled_call_impl is None for layer in layers)
        assert [layer._compiled_call_impl for layer in layers] == calls
    assert all(layer._compiled_call_impl is None for layer in layers)
    with pytest.raises(RuntimeError, match="mid-step"), compiled.switched(model, True):
        raise RuntimeError("mid-step")
    assert all(layer._compiled_call_impl is None for layer in layers)


def test_trainer_rejects_compile_layers_it_cannot_run(tmp_path, monkeypatch):
    from cb_sync.integrations.trl.training import training_step_compile
    from cb_sync.integrations.trl import CBSyncGRPOTrainer
    from test_integration_trl import dataset, even_fraction, grpo_args, tiny_model, tokenizer

    common = dict(model=tiny_model(), reward_funcs=even_fraction, args=grpo_args(tmp_path), train_dataset=dataset(),
                  processing_class=tokenizer())
    with pytest.raises(ValueError, match="compile_layers must be True or False, got 'yes'"):
        CBSyncGRPOTrainer(compile_layers="yes", **common)
    with pytest.raises(ValueError, match="batch_invariant"):
        CBSyncGRPOTrainer(compile_layers=True, cb_config=CBConfig(batch_invariant=True), **common)
    monkeypatch.setattr(training_step_compile, "decoder_layers", lambda model: [])
    with pytest.raises(ValueError, match="Qwen3ForCausalLM has none"):
        CBSyncGRPOTrainer(compile_layers=True, **common)


@pytest.mark.slow
def test_trainer_compiles_layers_for_its_forwards_not_its_rollouts_and_trains_as_eager(tmp_path, monkeypatch):
    """CBSyncGRPOTrainer(compile_layers=True) with LoRA and gradient checkpointing: its logprob forwards and the
    backward's recompute run the compiled layers, its rollouts the eager ones; the layers are eager again after
    training, and the trained weights equal those of an eager run up to rounding."""
    from trl import GRPOTrainer

    from cb_sync.integrations.trl import CBSyncGRPOTrainer
    from test_integration_trl import dataset, even_fraction, grpo_args, tiny_model, tokenizer

    seen = {"forward": set(), "rollout": set()}
    trl_forward, generate = GRPOTrainer._get_per_token_logps_and_entropies, SyncCBDriver.generate

    def compiled(model) -> set[bool]:
        return {layer._compiled_call_impl is not None for layer in decoder_layers(model)}

    def recording_forward(self, model, *args, **kwargs):
        seen["forward"].update(compiled(model))
        return trl_forward(self, model, *args, **kwargs)

    def recording_generate(driver, *args, **kwargs):
        seen["rollout"].update(compiled(driver.model))
        return generate(driver, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", recording_forward)
    monkeypatch.setattr(SyncCBDriver, "generate", recording_generate)

    def train(compile_layers: bool) -> dict:
        trainer = CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction,
                                    args=grpo_args(tmp_path, max_steps=2, beta=0.1, learning_rate=1e-3,
                                                   gradient_checkpointing=True),
                                    train_dataset=dataset(), processing_class=tokenizer(),
                                    cb_config=CBConfig(block_size=4, max_batch_tokens=64),
                                    peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS),
                                    compile_layers=compile_layers)
        trainer.train()
        assert compiled(trainer.model) == {False}
        return {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if "lora_" in k}

    eager = train(False)
    assert seen == {"forward": {False}, "rollout": {False}}
    seen = {"forward": set(), "rollout": set()}
    counters["stats"].clear()
    fused = train(True)
    assert seen == {"forward": {True}, "rollout": {False}}
    assert counters["stats"]["unique_graphs"] >= 1      # the layers' calls were compiled, not skipped
    assert eager.keys() == fused.keys() and eager
    for k in eager:
        torch.testing.assert_close(fused[k], eager[k], rtol=1e-4, atol=1e-5)
