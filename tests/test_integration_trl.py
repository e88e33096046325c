"""cb_sync.integrations.trl: CBSyncGRPOTrainer, and TRL's own continuous-batching path on cb_sync (CPU, fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from cb_sync import CBConfig, SyncCBDriver  # noqa: E402
from cb_sync.integrations.transformers import disable, enable  # noqa: E402
from cb_sync.integrations.trl import exact_mode, generation  # noqa: E402
from cb_sync.integrations.trl import trainer as trl_trainer  # noqa: E402
from cb_sync.integrations.trl.training import logprob_gap  # noqa: E402
from cb_sync.integrations.trl import CBSyncGRPOTrainer  # noqa: E402

VOCAB = 128
STEPS = 3


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>")


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         initializer_range=0.02,  # flat logits: samples within a group differ
                         eos_token_id=1, pad_token_id=0, bos_token_id=2)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def dataset() -> Dataset:
    gen = torch.Generator().manual_seed(0)
    prompts = [" ".join(f"t{t}" for t in torch.randint(3, VOCAB, (int(n),), generator=gen).tolist())
               for n in torch.randint(3, 9, (16,), generator=gen)]
    return Dataset.from_dict({"prompt": prompts})


def even_fraction(completion_ids, **kwargs) -> list[float]:
    """Reward: the fraction of even token ids (has variance within a group of random samples)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def grpo_args(tmp_path, **extra) -> GRPOConfig:
    fields = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                  max_steps=STEPS, learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
                  save_strategy="no", seed=0, dataloader_num_workers=0)
    return GRPOConfig(**{**fields, **extra})


class Spy:
    """Records every SyncCBDriver.generate / release call: the model's mode around it and what came back."""

    def __init__(self, monkeypatch):
        self.calls, self.releases, self.release_kwargs = [], 0, []
        generate, release = SyncCBDriver.generate, SyncCBDriver.release

        def spy_generate(drv, prompts, params=None, seed=None, **kwargs):
            before, checkpointing = drv.model.training, drv.model.is_gradient_checkpointing
            results = generate(drv, prompts, params, seed, **kwargs)
            self.calls.append(dict(driver=drv, prompts=[list(p) for p in prompts], params=params, before=before,
                                   after=drv.model.training, results=results,
                                   checkpointing=(checkpointing, drv.model.is_gradient_checkpointing)))
            return results

        def spy_release(drv, **kwargs):
            self.releases += 1
            self.release_kwargs.append(kwargs)
            return release(drv, **kwargs)

        monkeypatch.setattr(SyncCBDriver, "generate", spy_generate)
        monkeypatch.setattr(SyncCBDriver, "release", spy_release)


def forbid_hf_generate(monkeypatch, *modules):
    def boom(*args, **kwargs):
        raise AssertionError("HF generate() was called")

    for module in modules:
        monkeypatch.setattr(module, "generate", boom)


def logged(trainer, key) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def check_groups_and_logprobs(spy, num_generations=4):
    for call in spy.calls:
        prompts, results = call["prompts"], call["results"]
        # TRL passes each prompt repeated num_generations times; results stay aligned with prompts
        assert [r.prompt_ids for r in results] == prompts
        for g in range(0, len(prompts), num_generations):
            assert all(p == prompts[g] for p in prompts[g:g + num_generations])
            group = [tuple(r.token_ids) for r in results[g:g + num_generations]]
            assert len(set(group)) > 1, "identical samples in a group"
        for r in results:
            assert r.logprobs is not None and len(r.logprobs) == len(r.token_ids) > 0
            assert all(lp <= 0.0 for lp in r.logprobs) and min(r.logprobs) < -1.0


def check_training(trainer, before: dict, model):
    grad_norms = logged(trainer, "grad_norm")
    assert len(grad_norms) == STEPS and all(g > 0 for g in grad_norms)
    assert all(s > 0 for s in logged(trainer, "reward_std"))
    assert all(f < 1.0 for f in logged(trainer, "frac_reward_zero_std"))
    after = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    assert any(not torch.equal(before[n], after[n]) for n in before), "no trainable parameter changed"


def snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_grpo_runs_on_cb_sync(tmp_path, monkeypatch):
    spy = Spy(monkeypatch)
    returned = []       # cached blocks given back before each rollout, while its KV pools are not allocated yet
    monkeypatch.setattr(generation, "return_allocator_cache",
                        lambda device: returned.append(spy.calls[-1]["driver"].cache.num_blocks if spy.calls else 0))
    model = tiny_model()
    forbid_hf_generate(monkeypatch, model)
    trainer = CBSyncGRPOTrainer(model=model, reward_funcs=even_fraction, args=grpo_args(tmp_path, top_k=20,
                                                                                         temperature=0.9),
                                train_dataset=dataset(), processing_class=tokenizer(),
                                cb_config=CBConfig(block_size=4, max_batch_tokens=64), release_after_rollout=True)
    params = trainer.cb_generation.sampling_params
    assert (params.do_sample, params.temperature, params.top_k, params.max_new_tokens) == (True, 0.9, 20, 8)
    assert params.logprobs and params.seed is None and 1 in params.eos_token_id
    before = snapshot(model)
    trainer.train()  # GRPOConfig's gradient_checkpointing=True: the Trainer turns it on when training starts

    assert len(spy.calls) == STEPS and spy.releases == STEPS  # one rollout per step, KV freed after each
    assert spy.release_kwargs == [{"keep_graphs": True}] * STEPS
    assert returned == [0] * STEPS
    assert len({id(c["driver"]) for c in spy.calls}) == 1  # one persistent driver
    assert spy.calls[0]["driver"].model is model
    assert all(c["before"] and c["after"] for c in spy.calls)  # train mode before and after every rollout
    assert all(len(c["prompts"]) == 8 for c in spy.calls)
    assert all(c["checkpointing"] == (True, True) for c in spy.calls)  # left on through the rollouts
    assert model.is_gradient_checkpointing
    check_groups_and_logprobs(spy)
    check_training(trainer, before, model)
    # generator and trainer logprobs agree (same fp32 modules; only the attention kernel differs)
    means, peaks = (logged(trainer, f"sampling/sampling_logp_difference/{k}") for k in ("mean", "max"))
    assert len(means) == STEPS and all(0.0 <= m <= p < 1e-3 for m, p in zip(means, peaks))


def test_logprob_gap_comes_from_the_loss_forward(tmp_path, monkeypatch):
    """No forward of its own: the gap logged per step is over both micro-batches' completion tokens, against what a
    separate no-grad forward of the same weights gives (the trainer's old logps, which TRL leaves out here)."""
    counted = []
    forward = CBSyncGRPOTrainer._get_per_token_logps_and_entropies

    def counting(self, *args, **kwargs):
        counted.append(self.state.global_step)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(CBSyncGRPOTrainer, "_get_per_token_logps_and_entropies", counting)
    trainer = CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction,
                                args=grpo_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2),
                                train_dataset=dataset(), processing_class=tokenizer(),
                                cb_config=CBConfig(block_size=4, max_batch_tokens=64))
    loss, expected = trainer._compute_loss, {}

    def loss_with_reference(model, inputs):
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with torch.no_grad():
            logps, _, _ = forward(trainer, model, ids, mask, inputs["completion_ids"].size(1))
        delta = (logps - inputs["sampling_per_token_logps"])[inputs["completion_mask"].bool()]
        expected.setdefault(trainer.state.global_step, []).append(delta)
        return loss(model, inputs)

    trainer._compute_loss = loss_with_reference
    trainer.train()
    assert [counted.count(step) for step in range(STEPS)] == [2] * STEPS     # the two micro-batches' losses only
    deltas = [torch.cat(expected[step]) for step in range(STEPS)]
    assert all(len(expected[step]) == 2 for step in range(STEPS))
    means, p95s, peaks = (logged(trainer, f"sampling/sampling_logp_difference/{k}") for k in ("mean", "p95", "max"))
    assert means == pytest.approx([d.abs().mean().item() for d in deltas], rel=1e-5, abs=1e-9)
    assert p95s == pytest.approx([d.abs().quantile(0.95).item() for d in deltas], rel=1e-5, abs=1e-9)
    assert peaks == pytest.approx([d.abs().max().item() for d in deltas], rel=1e-5, abs=1e-9)
    assert all(0.0 < m <= q <= p < 1e-3 for m, q, p in zip(means, p95s, peaks))
    assert logged(trainer, "sampling/ratio_outside_0.9_1.1") == [0.0] * STEPS    # fp32 on both sides


def test_ratio_outside_counts_tokens_beyond_ten_percent(tmp_path):
    """The log's gap statistics over every batch added since the last log: |delta| mean / p95 / max and the share
    of tokens whose ratio exp(delta) lies outside [0.9, 1.1]."""
    trainer = CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction, args=grpo_args(tmp_path),
                                train_dataset=dataset(), processing_class=tokenizer())
    generator = torch.zeros(2, 3)
    batches = ((torch.tensor([[0.2, -0.2, 0.05], [0.0, 0.09, -0.1]]), torch.ones(2, 3)),
               (torch.tensor([[-0.11, 5.0, 0.0], [0.0, 0.0, 0.0]]), torch.tensor([[1, 0, 0], [0, 0, 0]])))
    for trainer_logps, mask in batches:
        trainer._logprob_gap.add(trainer_logps, {"completion_mask": mask, "sampling_per_token_logps": generator},
                                 trainer._mode())
    trainer.log({})
    delta = torch.tensor([0.2, -0.2, 0.05, 0.0, 0.09, -0.1, -0.11])    # the masked 5.0 is left out
    entry = trainer.state.log_history[-1]
    assert entry["sampling/sampling_logp_difference/mean"] == pytest.approx(delta.abs().mean().item())
    assert entry["sampling/sampling_logp_difference/p95"] == pytest.approx(delta.abs().quantile(0.95).item())
    assert entry["sampling/sampling_logp_difference/max"] == pytest.approx(0.2)
    # outside [0.9, 1.1]: 0.2 and -0.2 and -0.11 (exp(-0.1) = 0.905 is inside, exp(0.09) = 1.094 too)
    assert entry["sampling/ratio_outside_0.9_1.1"] == pytest.approx(3 / 7)


def test_grpo_with_peft_config_and_importance_sampling(tmp_path, monkeypatch):
    from peft import LoraConfig

    spy = Spy(monkeypatch)
    model = tiny_model()
    forbid_hf_generate(monkeypatch, model)
    peft_config = LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])
    trainer = CBSyncGRPOTrainer(model=model, reward_funcs=even_fraction, args=grpo_args(tmp_path),
                                train_dataset=dataset(), processing_class=tokenizer(), peft_config=peft_config,
                                importance_sampling_correction=True)
    peft_model = trainer.model
    assert hasattr(peft_model, "get_base_model")
    forbid_hf_generate(monkeypatch, peft_model)
    before = snapshot(peft_model)
    assert before and all("lora_" in n for n in before)
    trainer.train()

    assert len(spy.calls) == STEPS and spy.releases == 0      # release_after_rollout=None: a small cache is kept
    assert spy.calls[0]["driver"].model is peft_model and all(c["before"] and c["after"] for c in spy.calls)
    check_groups_and_logprobs(spy)
    check_training(trainer, before, peft_model)
    ratios = logged(trainer, "sampling/importance_sampling_ratio/mean")
    assert len(ratios) == STEPS and all(abs(r - 1.0) < 1e-3 for r in ratios)
    assert all(d < 1e-3 for d in logged(trainer, "sampling/sampling_logp_difference/max"))
    assert trainer.use_vllm is False  # the flag is only flipped for the duration of TRL's calls


@pytest.mark.parametrize("batch_invariant, kernels",
                         [(True, False), pytest.param(True, True, marks=pytest.mark.slow), (False, False)],
                         ids=["invariant", "invariant_kernels", "default"])
def test_batch_invariant_rollouts_are_exactly_on_policy(tmp_path, monkeypatch, batch_invariant, kernels):
    """CBConfig(batch_invariant=True): the generator's logprob of every completion token equals, bit for bit, the
    loss's (with grad, through gradient checkpointing): the gap is exactly 0. With the importance-sampling correction
    TRL's old logps are the generator's own (no forward runs for them): TRL's gap is 0 and every ratio exactly 1. The
    default mode's (fp32) gap is small, not 0. LoRA with prompts of several lengths (left padding), chunked prefill
    and two micro-batches; kernels: both sides through the (interpreted) Triton kernels, as on CUDA (the LoRA
    kernel's differentiable op in the loss's forward)."""
    from peft import LoraConfig

    if kernels:      # the row-mean kernel (a program per row: slow when interpreted) is tested on its own
        from test_batch_invariant import serve_kernels
        serve_kernels(monkeypatch, means=False)
    pairs = []
    add = logprob_gap.LogprobGap.add

    def recording(self, trainer_logps, batch, mode):
        mask = batch["completion_mask"].bool()
        pairs.append((trainer_logps[mask], batch["sampling_per_token_logps"][mask]))
        return add(self, trainer_logps, batch, mode)

    monkeypatch.setattr(logprob_gap.LogprobGap, "add", recording)
    peft_config = LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    for correction in (False,) if kernels else (True, False):   # the interpreted kernels: the loss's side only
        pairs.clear()
        trainer = CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction,
                                    args=grpo_args(tmp_path, max_steps=2, per_device_train_batch_size=4,
                                                   gradient_accumulation_steps=2, temperature=0.8),
                                    train_dataset=dataset(), processing_class=tokenizer(), peft_config=peft_config,
                                    importance_sampling_correction=correction,
                                    cb_config=CBConfig(block_size=4, max_batch_tokens=16,
                                                       batch_invariant=batch_invariant))
        trainer.train()
        peaks = logged(trainer, "sampling/sampling_logp_difference/max")   # TRL's own metric with the correction
        assert len(peaks) == 2 and (peaks == [0.0, 0.0]) == batch_invariant and max(peaks) < 1e-3
        if not correction:                          # the gap against the loss's own logprobs, with gradients
            assert sum(t.numel() for t, _ in pairs) > 0
            assert all(torch.equal(t, g) for t, g in pairs) == batch_invariant
        else:
            for stat in ("min", "mean", "max"):
                ratios = logged(trainer, f"sampling/importance_sampling_ratio/{stat}")
                assert len(ratios) == 2 and (ratios == [1.0, 1.0] or not batch_invariant)
        assert all(g > 0 for g in logged(trainer, "grad_norm"))


def test_release_after_rollout_none_frees_only_caches_over_the_limit(tmp_path, monkeypatch):
    """The default (None): a KV cache larger than KEPT_CACHE_MAX_BYTES is freed after a rollout, a smaller one kept;
    True and False decide whatever the size; other values are refused before any work."""
    from cb_sync.integrations.trl.generation import KEPT_CACHE_MAX_BYTES, releases_cache

    assert KEPT_CACHE_MAX_BYTES == 1 << 30
    assert not releases_cache(None, KEPT_CACHE_MAX_BYTES) and releases_cache(None, KEPT_CACHE_MAX_BYTES + 1)
    assert releases_cache(True, 0) and not releases_cache(False, 1 << 40)
    spy = Spy(monkeypatch)
    sizes = []
    monkeypatch.setattr(generation, "KEPT_CACHE_MAX_BYTES", 1000)     # below this tiny model's cache
    monkeypatch.setattr(generation, "releases_cache", lambda asked, size: sizes.append(size) or
                        releases_cache(asked, size))
    CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction, args=grpo_args(tmp_path, max_steps=1),
                      train_dataset=dataset(), processing_class=tokenizer()).train()
    assert len(spy.calls) == 1 and spy.releases == 1 and sizes[0] > 1000
    assert spy.calls[0]["driver"].cache.nbytes == 0
    with pytest.raises(ValueError, match="release_after_rollout must be True, False or None, got 'yes'"):
        CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction, args=grpo_args(tmp_path),
                          train_dataset=dataset(), processing_class=tokenizer(), release_after_rollout="yes")


def test_batch_invariant_scores_the_reference_on_the_default_path(tmp_path, monkeypatch):
    """In batch-invariant mode the reference policy's forward (beta > 0: the PEFT model with its adapters disabled)
    takes the default path (trimmed of shared padding), the policy's forwards the invariant one, and the gap stays
    exactly 0; `scores_reference` also knows TRL's ref_model and a "ref" adapter."""
    from peft import LoraConfig

    paths = []
    invariant, default = exact_mode.invariant_token_logprobs, trl_trainer.trimmed_logps_and_entropies

    def adapters_on(model):
        return not any(m.disable_adapters for m in exact_mode.adapter_layers(model))

    def recording_invariant(model, *args, **kwargs):
        paths.append(("invariant", adapters_on(model)))
        return invariant(model, *args, **kwargs)

    def recording_default(trl_forward, model, *args, unwrapped, **kwargs):
        paths.append(("default", adapters_on(unwrapped)))
        return default(trl_forward, model, *args, unwrapped=unwrapped, **kwargs)

    monkeypatch.setattr(exact_mode, "invariant_token_logprobs", recording_invariant)
    monkeypatch.setattr(trl_trainer, "trimmed_logps_and_entropies", recording_default)
    trainer = CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction,
                                args=grpo_args(tmp_path, max_steps=1, beta=0.1), train_dataset=dataset(),
                                processing_class=tokenizer(),
                                peft_config=LoraConfig(r=4, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
                                cb_config=CBConfig(block_size=4, max_batch_tokens=16, batch_invariant=True))
    trainer.train()
    assert ("default", False) in paths and ("invariant", True) in paths
    assert set(paths) == {("default", False), ("invariant", True)}
    assert logged(trainer, "sampling/sampling_logp_difference/max") == [0.0]
    assert logged(trainer, "kl")[0] < 1e-6       # policy and reference are the same weights at step 1
    model = trainer.accelerator.unwrap_model(trainer.model)

    def scores_reference(m) -> bool:
        return exact_mode.scores_reference(m, trainer.accelerator.unwrap_model(m), trainer.ref_model)

    with torch.no_grad():
        assert not scores_reference(model)
        with model.disable_adapter():
            assert scores_reference(model)
        trainer.ref_model = tiny_model()
        assert scores_reference(trainer.ref_model) and not scores_reference(model)
        model.add_adapter("ref", LoraConfig(r=4, lora_dropout=0.0, target_modules=["q_proj"]))
        model.set_adapter("ref")
        assert scores_reference(model)
    with model.disable_adapter():           # a forward with gradients is the policy's
        assert not scores_reference(model)


def test_batch_invariant_training_refuses_dropout(tmp_path):
    from peft import LoraConfig

    with pytest.raises(ValueError, match=r"Dropout\(p=0.1\): set lora_dropout=0"):
        CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction, args=grpo_args(tmp_path),
                          train_dataset=dataset(), processing_class=tokenizer(),
                          peft_config=LoraConfig(r=4, lora_dropout=0.1, target_modules=["q_proj"]),
                          cb_config=CBConfig(batch_invariant=True))
    model = tiny_model()
    model.config.attention_dropout = 0.1         # a rate the model's forward applies through F.dropout
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        CBSyncGRPOTrainer(model=model, reward_funcs=even_fraction, args=grpo_args(tmp_path), train_dataset=dataset(),
                          processing_class=tokenizer(), cb_config=CBConfig(batch_invariant=True))


def test_grpo_with_already_wrapped_peft_model(tmp_path, monkeypatch):
    from peft import LoraConfig, get_peft_model

    spy = Spy(monkeypatch)
    peft_model = get_peft_model(tiny_model(), LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    forbid_hf_generate(monkeypatch, peft_model, peft_model.get_base_model())
    before = snapshot(peft_model)
    trainer = CBSyncGRPOTrainer(model=peft_model, reward_funcs=even_fraction, args=grpo_args(tmp_path),
                                train_dataset=dataset(), processing_class=tokenizer(), release_after_rollout=False)
    trainer.train()
    assert len(spy.calls) == STEPS and spy.releases == 0
    assert spy.calls[0]["driver"].model is peft_model
    check_groups_and_logprobs(spy)
    check_training(trainer, before, peft_model)
    assert all(d < 1e-3 for d in logged(trainer, "sampling/sampling_logp_difference/max"))


def test_trl_continuous_batching_path_runs_on_cb_sync(tmp_path, monkeypatch):
    spy = Spy(monkeypatch)
    model = enable(tiny_model(), CBConfig(block_size=8))
    forbid_hf_generate(monkeypatch, model)
    before = snapshot(model)
    trainer = GRPOTrainer(model=model, reward_funcs=even_fraction,
                          args=grpo_args(tmp_path, use_transformers_continuous_batching=True),
                          train_dataset=dataset(), processing_class=tokenizer())
    trainer.train()
    assert len(spy.calls) == STEPS and spy.releases == STEPS  # persistent_manager=False releases after each call
    assert all(c["before"] for c in spy.calls)
    for call in spy.calls:
        p = call["params"][0]
        assert p.do_sample and p.max_new_tokens == 8 and p.top_k == 0 and 1 in p.eos_token_id
    check_training(trainer, before, model)
    disable(model)


def test_refuses_conflicting_backends_and_options(tmp_path):
    with pytest.raises(ValueError, match="use_vllm"):
        CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction,
                          args=grpo_args(tmp_path, use_transformers_continuous_batching=True),
                          train_dataset=dataset(), processing_class=tokenizer())
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction,
                          args=grpo_args(tmp_path, generation_kwargs={"no_repeat_ngram_size": 2}),
                          train_dataset=dataset(), processing_class=tokenizer())


def test_repetition_penalty_and_vllms_penalties_reach_the_rollouts(tmp_path):
    """GRPOConfig.repetition_penalty, and vLLM's presence_penalty, frequency_penalty and min_tokens passed through
    generation_kwargs (as TRL's vLLM path takes them), set the rollouts' SamplingParams."""
    kwargs = {"presence_penalty": 0.5, "frequency_penalty": 0.25, "min_tokens": 2}
    trainer = CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction,
                                args=grpo_args(tmp_path, repetition_penalty=1.3, generation_kwargs=kwargs),
                                train_dataset=dataset(), processing_class=tokenizer())
    p = trainer.cb_generation.sampling_params
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_new_tokens) == (1.3, 0.5, 0.25, 2)
    ids, _ = trainer._generate_single_turn([[5, 6, 7]] * 4, None, {}, num_generations=4)
    assert all(len(tokens) >= 3 for tokens in ids)      # EOS not before min_tokens


def test_generation_kwargs_reach_the_rollouts_as_in_trls_own_path(tmp_path):
    trainer = CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction,
                                args=grpo_args(tmp_path, generation_kwargs={"max_new_tokens": 3, "eos_token_id": [7]}),
                                train_dataset=dataset(), processing_class=tokenizer())
    params = trainer.cb_generation.sampling_params
    assert (params.max_new_tokens, params.eos_token_id) == (3, [7])
    with pytest.raises(ValueError, match="log_logprob_diff must be True or False, got 'yes'"):
        CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction, args=grpo_args(tmp_path),
                          train_dataset=dataset(), processing_class=tokenizer(), log_logprob_diff="yes")


def test_the_logprob_gaps_quantile_is_torchs_at_any_size():
    values = torch.rand(1001, generator=torch.Generator().manual_seed(0))
    assert logprob_gap.quantile(values, 0.95) == pytest.approx(torch.quantile(values, 0.95).item(), rel=1e-6)
    many = torch.rand(2**24 + 3, generator=torch.Generator().manual_seed(1))    # past torch.quantile's limit
    assert logprob_gap.quantile(many, 0.95) == pytest.approx(float(np.quantile(many.numpy(), 0.95)), rel=1e-6)


def test_generate_single_turn_contract(tmp_path, monkeypatch):
    """TRL 1.16's hook: (prompt_ids, images, multimodal_fields, num_generations, has_tool_images) -> (ids, logprobs)."""
    spy = Spy(monkeypatch)
    trainer = CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction, args=grpo_args(tmp_path),
                                train_dataset=dataset(), processing_class=tokenizer())
    prompts = [[5, 6, 7], [5, 6, 7], [9, 10], [11, 12, 13, 14]]  # e.g. the tool loop's per-sample histories
    ids, logprobs = trainer._generate_single_turn(prompts, None, {}, num_generations=1)
    assert len(ids) == len(logprobs) == len(prompts) and spy.calls[-1]["prompts"] == prompts
    assert ids == [r.token_ids for r in spy.calls[-1]["results"]]  # aligned with the prompts
    assert logprobs == [r.logprobs for r in spy.calls[-1]["results"]]
    for tokens, lps in zip(ids, logprobs):
        assert 0 < len(tokens) <= 8 and len(lps) == len(tokens) and all(isinstance(t, int) for t in tokens)
        assert tokens[-1] == 1 or len(tokens) == 8  # ends at EOS (kept) or at max_completion_length
    assert ids[0] != ids[1]  # same prompt, different samples
    with pytest.raises(NotImplementedError):
        trainer._generate_single_turn(prompts, [None] * 4, {}, num_generations=1, has_tool_images=True)


def test_the_exact_mode_takes_the_generators_logprobs_as_trls_old_logps(tmp_path, monkeypatch):
    """Where TRL scores a rollout again before training on it (num_iterations=2: its old logps), the exact mode
    hands it the generator's logprobs instead: no forward of the policy without gradients runs, TRL's old logps
    are the generator's, and no gap is logged from them (they are its own numbers)."""
    from peft import LoraConfig

    forwards, scored = [], []
    invariant = exact_mode.invariant_token_logprobs
    monkeypatch.setattr(exact_mode, "invariant_token_logprobs",
                        lambda *args, **kwargs: forwards.append(torch.is_grad_enabled()) or invariant(*args, **kwargs))
    trainer = CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction,
                                args=grpo_args(tmp_path, max_steps=2, per_device_train_batch_size=4,
                                               gradient_accumulation_steps=2, num_iterations=2),
                                train_dataset=dataset(), processing_class=tokenizer(),
                                peft_config=LoraConfig(r=4, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
                                cb_config=CBConfig(block_size=4, max_batch_tokens=16, batch_invariant=True))
    score = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: scored.append(score(inputs)) or scored[-1]
    trainer.train()
    assert scored and forwards and all(forwards)
    for output in scored:
        mask = output["completion_mask"].bool()
        assert torch.equal(output["old_per_token_logps"][mask], output["sampling_per_token_logps"][mask])
    assert logged(trainer, "sampling/sampling_logp_difference/max") == []
    assert all(g > 0 for g in logged(trainer, "grad_norm"))
