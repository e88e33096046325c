"""GRPO micro-batches grouped by length, forwards without shared padding (`group_by_length=True`)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from transformers import AutoModelForCausalLM, GPT2Config  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from cb_sync import CBConfig  # noqa: E402
from cb_sync.integrations.trl.training import length_groups  # noqa: E402
from cb_sync.integrations.trl.training.length_groups import (by_length, left_padded, padding_columns,  # noqa: E402
                                                             right_extended)
from cb_sync.integrations.trl import CBSyncGRPOTrainer  # noqa: E402

from test_integration_trl import dataset, even_fraction, grpo_args, logged, tiny_model, tokenizer  # noqa: E402


def _padded_rows(prompt_lengths, completion_lengths, prompt_width, completion_width, gen):
    """Left-padded prompts and right-padded completions of random tokens with these lengths."""
    rows = len(prompt_lengths)
    prompt_mask = (torch.arange(prompt_width) >= prompt_width - torch.tensor(prompt_lengths)[:, None]).long()
    completion_mask = (torch.arange(completion_width) < torch.tensor(completion_lengths)[:, None]).long()
    return {"prompt_ids": torch.randint(3, 100, (rows, prompt_width), generator=gen) * prompt_mask,
            "prompt_mask": prompt_mask,
            "completion_ids": torch.randint(3, 100, (rows, completion_width), generator=gen) * completion_mask,
            "completion_mask": completion_mask}


def test_by_length_regroups_the_same_rows_in_order_of_length():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))
    rows, size = 12, 4
    prompts = torch.randint(1, 7, (rows,), generator=gen).tolist()
    completions = torch.randint(0, 9, (rows,), generator=gen).tolist()
    batch = _padded_rows(prompts, completions, 6, 8, gen)
    batch["row"] = torch.arange(rows)
    batch["ref_per_token_logps"] = torch.arange(rows)[:, None] * 100.0 + torch.arange(8)
    batch["names"] = [f"r{i}" for i in range(rows)]
    micro_batches = [{**{key: value[i:i + size] for key, value in batch.items()},
                      "num_items_in_batch": torch.tensor(sum(completions)), "old_per_token_logps": None}
                     for i in range(0, rows, size)]
    grouped = by_length(micro_batches)

    assert [len(b["row"]) for b in grouped] == [size] * 3
    order = torch.cat([b["row"] for b in grouped])
    assert sorted(order.tolist()) == list(range(rows))
    keys = [(completions[r], prompts[r]) for r in order.tolist()]
    assert keys == sorted(keys)
    for b in grouped:                             # every value follows its row
        for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "ref_per_token_logps"):
            assert torch.equal(b[key], batch[key][b["row"]])
        assert b["names"] == [f"r{r}" for r in b["row"].tolist()]
        assert b["num_items_in_batch"] == sum(completions) and b["old_per_token_logps"] is None


def test_padding_columns_keep_the_scored_columns():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0],
                         [0, 0, 0, 1, 1, 0, 0, 0]])
    assert padding_columns(mask, 4) == (2, 2)       # prompt: columns 0-3, completion: 4-7
    assert padding_columns(mask, 1) == (2, 0)       # one completion column: nothing trailing to cut
    assert padding_columns(torch.ones(2, 8), 4) == (0, 0)
    left = torch.tensor([[0, 0, 0, 0, 1, 0]])       # an empty prompt row
    assert padding_columns(left, 2) == (3, 1)       # the prompt's last column stays: it scores the first token


def test_left_padded_widens_to_the_multiple_with_masked_pad_columns():
    ids, mask = torch.arange(1, 11).view(2, 5), torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    wide_ids, wide_mask = left_padded(ids, mask, pad_token_id=7, multiple=8)
    assert wide_ids.shape == wide_mask.shape == (2, 8)
    assert torch.equal(wide_ids[:, 3:], ids) and torch.equal(wide_mask[:, 3:], mask)
    assert (wide_ids[:, :3] == 7).all() and (wide_mask[:, :3] == 0).all()
    assert left_padded(ids, mask, 7, multiple=5)[0] is ids           # already a multiple: unchanged
    assert left_padded(ids, mask, 7)[0].shape[1] == length_groups.WIDTH_MULTIPLE == 128


def test_right_extended_appends_attended_pad_columns_up_to_the_multiple():
    ids, mask = torch.arange(1, 11).view(2, 5), torch.ones(2, 5, dtype=torch.long)
    wide_ids, wide_mask, extra = right_extended(ids, mask, pad_token_id=7, multiple=8)
    assert extra == 3 and wide_ids.shape == wide_mask.shape == (2, 8)
    assert torch.equal(wide_ids[:, :5], ids) and (wide_ids[:, 5:] == 7).all() and bool(wide_mask.all())
    assert right_extended(ids, mask, 7, multiple=5) == (ids, mask, 0)               # already a multiple
    assert right_extended(ids, mask, 7)[0].shape[1] == length_groups.UNMASKED_WIDTH_MULTIPLE == 32


def test_widths_with_padding_are_kept_off_the_faulty_remainder():
    """cuDNN attention's NaN-gradient widths (64 past a multiple of 128, with a mask) are widened to the next multiple
    of 128, padding on the left; other widths, and forwards without padding, are left alone; WIDTH_MULTIPLE's widths
    are never faulty."""
    modulus, remainder = length_groups.FAULTY_WIDTH
    assert length_groups.WIDTH_MULTIPLE % modulus == 0
    for width in (64, 192, 704):
        ids = torch.randint(3, 100, (2, width))
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        wide_ids, wide_mask = length_groups.clear_of_faulty_width(ids, mask, pad_token_id=0)
        assert wide_ids.shape[1] == width + 64 and wide_ids.shape[1] % modulus == 0
        assert torch.equal(wide_ids[:, 64:], ids) and torch.equal(wide_mask[:, 64:], mask)
        assert not wide_mask[:, :64].any() and (wide_ids[:, :64] == 0).all()
        full = torch.ones_like(ids)
        assert length_groups.clear_of_faulty_width(ids, full, 0)[0] is ids            # no mask: no fault
        other = torch.randint(3, 100, (2, width + 1))
        assert length_groups.clear_of_faulty_width(other, torch.zeros_like(other), 0)[0] is other


@pytest.fixture
def trainer(tmp_path):
    return CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction,
                             args=grpo_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                            max_steps=2),
                             train_dataset=dataset(), processing_class=tokenizer(),
                             cb_config=CBConfig(block_size=4, max_batch_tokens=64), group_by_length=True)


@pytest.mark.parametrize("grad", [False, True])
def test_trimmed_forward_equals_trl_forward_on_real_tokens(trainer, grad):
    """Against TRL's forward over the padded rows: the same logprobs and entropies on completion tokens (fp32; the
    trimmed prompts sit at other absolute positions, which rotary embeddings leave the same up to rounding), zeros
    on padding; chunks in order of length without gradients, gradients with them."""
    seed = int(torch.randint(0, 2 ** 31, ()))
    gen = torch.Generator().manual_seed(seed)
    rows = 10
    batch = _padded_rows(torch.randint(1, 9, (rows,), generator=gen).tolist(),
                         torch.randint(1, 12, (rows,), generator=gen).tolist(), 12, 16, gen)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    model = trainer.model
    with torch.set_grad_enabled(grad):
        expected = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, 16, batch_size=4,
                                                                 compute_entropy=True)
        got = trainer._get_per_token_logps_and_entropies(model, ids, mask, 16, batch_size=None if grad else 4,
                                                         compute_entropy=True)
    real = batch["completion_mask"].bool()
    for want, have in zip(expected[:2], got[:2]):
        assert have.shape == want.shape
        torch.testing.assert_close(have[real], want[real], atol=2e-5, rtol=1e-5, msg=lambda m: f"seed {seed}: {m}")
    for want, have in zip(expected[:2], got[:2]):                  # TRL's padding outputs are zeros too
        assert torch.equal(have[~real], want[~real])
    assert got[1].requires_grad == grad
    if grad:
        got[0][real].sum().backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_only_forwards_that_keep_padding_are_widened(trainer, monkeypatch):
    """A chunk whose rows fill every column keeps its width (and SDPA's unmasked causal path); one with padding left
    after trimming is left-padded to a multiple of WIDTH_MULTIPLE."""
    widths = []
    trl_forward = GRPOTrainer._get_per_token_logps_and_entropies

    def recording(self, model, input_ids, attention_mask, *args, **kwargs):
        widths.append((input_ids.shape[1], bool(attention_mask.all())))
        return trl_forward(self, model, input_ids, attention_mask, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", recording)
    gen = torch.Generator().manual_seed(0)
    full = _padded_rows([5, 5], [6, 6], 5, 6, gen)
    ragged = _padded_rows([5, 3], [6, 2], 5, 6, gen)
    with torch.no_grad():
        for batch in (full, ragged):
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
            mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
            trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 6)
    assert widths == [(11, True), (length_groups.WIDTH_MULTIPLE, False)]


@pytest.mark.parametrize("grad", [False, True])
def test_unmasked_forwards_on_cudnn_attention_widen_on_the_right(trainer, monkeypatch, grad):
    """Where SDPA takes cuDNN attention, a chunk without padding reaches TRL widened to a multiple of
    UNMASKED_WIDTH_MULTIPLE, still unmasked, and its logprobs and entropies are TRL's at the chunk's own width (fp32;
    the wider products round differently)."""
    from cb_sync.integrations.trl.training import logprob_forwards
    widths, trl_forward = [], GRPOTrainer._get_per_token_logps_and_entropies

    def recording(self, model, input_ids, attention_mask, *args, **kwargs):
        widths.append((input_ids.shape[1], bool(attention_mask.all())))
        return trl_forward(self, model, input_ids, attention_mask, *args, **kwargs)

    batch = _padded_rows([5, 5, 5], [6, 6, 6], 5, 6, torch.Generator().manual_seed(1))
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.set_grad_enabled(grad):
        expected = trl_forward(trainer, trainer.model, ids, mask, 6, compute_entropy=True)
        monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", recording)
        monkeypatch.setattr(logprob_forwards, "prefers_cudnn_attention", lambda model: True)
        got = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 6, compute_entropy=True)
    assert widths == [(length_groups.UNMASKED_WIDTH_MULTIPLE, True)]
    for want, have in zip(expected[:2], got[:2]):
        assert have.shape == want.shape == (3, 6)
        torch.testing.assert_close(have, want, atol=2e-5, rtol=1e-5)
    if grad:
        got[0].sum().backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.model.parameters())


def test_group_by_length_refuses_learned_positions_and_batch_invariant_mode(tmp_path):
    """Trimmed and widened rows sit at other positions, which a table of positions does not ignore; batch-invariant
    forwards skip padding themselves. group_by_length=True refuses both before any step."""
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                                       eos_token_id=1, pad_token_id=0, bos_token_id=2))
    for model, cb_config, named in ((gpt2, None, "learned absolute positions=True"),
                                    (tiny_model(), CBConfig(batch_invariant=True), "batch_invariant=True")):
        with pytest.raises(ValueError, match=named):
            CBSyncGRPOTrainer(model=model, reward_funcs=even_fraction, args=grpo_args(tmp_path, max_steps=1),
                              train_dataset=dataset(), processing_class=tokenizer(), cb_config=cb_config,
                              group_by_length=True)


@pytest.mark.parametrize("group_by_length", [True, False])
def test_gradient_forwards_on_cudnn_attention_avoid_the_faulty_width(tmp_path, monkeypatch, group_by_length):
    """Where SDPA takes cuDNN attention, a forward with gradients and padding never reaches TRL at a faulty width (the
    grouped path through WIDTH_MULTIPLE, even when set to 1, TRL's own by one more widening), and its logprobs are
    TRL's on the real tokens (fp32; rotary positions shift, equal up to rounding). Without gradients the width stays."""
    from cb_sync.integrations.trl.training import attention_warmup, logprob_forwards
    monkeypatch.setattr(length_groups, "WIDTH_MULTIPLE", 1)
    monkeypatch.setattr(attention_warmup, "warm_attention", lambda *args, **kwargs: None)
    trainer = CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction,
                                args=grpo_args(tmp_path, per_device_train_batch_size=4, max_steps=1),
                                train_dataset=dataset(), processing_class=tokenizer(), group_by_length=group_by_length)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))
    batch = _padded_rows([60, 50, 54, 3], [132, 130, 4, 120], 60, 132, gen)       # 192 columns, 64 past 128
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    assert ids.shape[1] % 128 == 64
    widths, trl_forward = [], GRPOTrainer._get_per_token_logps_and_entropies

    def recording(self, model, input_ids, attention_mask, *args, **kwargs):
        widths.append((torch.is_grad_enabled(), input_ids.shape[1]))
        return trl_forward(self, model, input_ids, attention_mask, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", recording)
    with torch.no_grad():
        expected = trl_forward(trainer, trainer.model, ids, mask, 132)[0]
    monkeypatch.setattr(logprob_forwards, "prefers_cudnn_attention", lambda model: True)
    got = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 132)[0]
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 132)
    real = batch["completion_mask"].bool()
    torch.testing.assert_close(got[real], expected[real], atol=2e-5, rtol=1e-5)
    grad_widths = [w for grad, w in widths if grad]
    assert grad_widths and all(w % 128 != 64 for w in grad_widths)
    if not group_by_length:
        assert grad_widths == [256] and [w for grad, w in widths if not grad] == [192]


def test_grouped_training_sees_sorted_micro_batches_and_forwards_without_shared_padding(trainer, monkeypatch):
    """Each step's micro-batches sorted; every forward trimmed of its shared padding (no widening here: it has a
    test of its own)."""
    monkeypatch.setattr(length_groups, "WIDTH_MULTIPLE", 1)
    seen, forwards = [], []
    loss, trl_forward = trainer._compute_loss, GRPOTrainer._get_per_token_logps_and_entropies

    def recording(model, inputs):
        seen.append((trainer.state.global_step, list(zip(inputs["completion_mask"].sum(1).tolist(),
                                                          inputs["prompt_mask"].sum(1).tolist())),
                     inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]))
        return loss(model, inputs)

    def recording_forward(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        forwards.append((padding_columns(attention_mask, logits_to_keep), input_ids.shape[1]))
        return trl_forward(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    trainer._compute_loss = recording
    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", recording_forward)
    trainer.train()
    for step in range(2):     # both micro-batches of a step, by completion then prompt length
        keys = [key for s, batch, _ in seen if s == step for key in batch]
        assert len(keys) == 8 and keys == sorted(keys)
        assert len({prompt for _, prompt in keys}) > 1
    assert len(forwards) >= 4 and all(columns == (0, 0) for columns, _ in forwards)   # nothing left to trim
    padded, trimmed = [width for _, _, width in seen], [width for _, width in forwards]
    assert min(trimmed) < max(padded)                                                # and something was trimmed
    assert all(g > 0 for g in logged(trainer, "grad_norm"))


@pytest.mark.parametrize("bad", [dict(steps_per_generation=4), dict(loss_type="bnpo"), dict(num_iterations=2),
                                 dict(top_entropy_quantile=0.5), dict(entropy_coef=0.01)])
def test_group_by_length_refuses_settings_that_regrouping_changes(tmp_path, bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        CBSyncGRPOTrainer(model=tiny_model(), reward_funcs=even_fraction,
                          args=grpo_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, **bad),
                          train_dataset=dataset(), processing_class=tokenizer(), group_by_length=True)


def test_group_by_length_is_on_by_default_where_the_settings_allow_it(tmp_path):
    """None (the default): on with TRL's defaults and one optimizer step per rollout; off, without an error, where
    regrouping would change the loss, in batch-invariant mode and for a model with learned absolute positions; False
    keeps TRL's micro-batches; other values are refused."""
    def made(group_by_length="default", cb_config=None, model=None, **extra):
        chosen = {} if group_by_length == "default" else dict(group_by_length=group_by_length)
        return CBSyncGRPOTrainer(model=model or tiny_model(), reward_funcs=even_fraction,
                                 args=grpo_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                                **extra),
                                 train_dataset=dataset(), processing_class=tokenizer(), cb_config=cb_config,
                                 **chosen).group_by_length

    assert made() is True and made(group_by_length=None) is True
    assert made(num_iterations=2) is False and made(loss_type="bnpo") is False
    assert made(cb_config=CBConfig(batch_invariant=True)) is False
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                                       eos_token_id=1, pad_token_id=0, bos_token_id=2))
    assert made(model=gpt2) is False            # learned absolute positions: trimmed rows would move
    assert made(group_by_length=False) is False
    with pytest.raises(ValueError, match="group_by_length must be"):
        made(group_by_length="yes")
