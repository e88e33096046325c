"""GRPO forwards with less padding (`group_by_length`). TRL pads a whole generation batch to its longest prompt and its
longest completion, then cuts it into micro-batches, so every forward of the loss is as wide as the longest sequence
of the rollout, most of it padding where lengths vary. `by_length` regroups the rows so that each micro-batch holds
completions of similar lengths; `padding_columns` finds the columns of one forward's rows that are padding in all of
them, which the forward can then skip; `left_padded` widens what is left to a multiple of WIDTH_MULTIPLE columns,
`right_extended` a forward without padding to a multiple of UNMASKED_WIDTH_MULTIPLE; `clear_of_faulty_width` widens a
forward of TRL's own whose width meets a cuDNN attention fault. `length_groups_wanted` decides whether a trainer
groups at all."""

from __future__ import annotations

import torch

from ....engine.validation import learned_position_limit

# Forwards are widened to a multiple of this many columns: cuDNN attention (PyTorch's SDPA choice on Hopper) builds a
# plan for every new sequence length, and micro-batches trimmed to their rows would have a new width almost every
# time; 128 columns add about 64 padding tokens a row on average. Not 64: see FAULTY_WIDTH.
WIDTH_MULTIPLE = 128

# Forwards without padding (every row as long) are widened on the right, with columns their causal attention keeps
# out of the real ones, to a multiple of this many: a run whose rows are all as long (fixed-length completions) would
# otherwise meet a new width, and cuDNN attention's plans for it, every few steps. Unmasked widths have no fault; 32
# columns cost about 16 tokens a row on average.
UNMASKED_WIDTH_MULTIPLE = 32

# With a mask, cuDNN attention's backward can return NaN query gradients at widths of 64 past a multiple of 128 for
# rows whose logsumexp underflows fp32 (below about -88.7), which fully masked (left-padding) rows do
# (pytorch/pytorch#196678). These widths are avoided on every torch version.
FAULTY_WIDTH = (128, 64)        # width % 128 == 64


def by_length(micro_batches: list[dict]) -> list[dict]:
    """The rows of equal-size micro-batches (TRL's split of one generation batch: dicts of [rows, ...] tensors, lists,
    and values shared by all, such as scalars and None), regrouped in order of completion length, then prompt length:
    the same rows, the same micro-batch sizes, every micro-batch's values in one row order."""
    size = len(micro_batches[0]["completion_mask"])
    merged = {key: _joined([batch[key] for batch in micro_batches]) for key in micro_batches[0]}
    completion, prompt = merged["completion_mask"].sum(1), merged["prompt_mask"].sum(1)
    order = torch.argsort(completion * (merged["prompt_mask"].shape[1] + 1) + prompt, stable=True).cpu()
    return [{key: _rows(value, order[start:start + size]) for key, value in merged.items()}
            for start in range(0, len(order), size)]


def padding_columns(attention_mask: torch.Tensor, logits_to_keep: int) -> tuple[int, int]:
    """(leading, trailing): how many first and last columns of attention_mask [B, T] (prompts left-padded, then the
    last logits_to_keep columns of completions, right-padded) are padding in every row. Leading ones stop before the
    prompt's last column, whose logits score the first completion token; trailing ones leave one completion column."""
    used = attention_mask.bool().any(0).nonzero()
    if used.numel() == 0:
        return 0, 0
    width = attention_mask.shape[1]
    leading = min(int(used[0]), width - logits_to_keep - 1)
    trailing = min(width - 1 - int(used[-1]), logits_to_keep - 1)
    return max(leading, 0), max(trailing, 0)


def left_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int,
                multiple: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, T] with padding columns added on the left, up to a width that is a multiple of
    `multiple` (WIDTH_MULTIPLE)."""
    extra = -input_ids.shape[1] % (multiple or WIDTH_MULTIPLE)
    if not extra:
        return input_ids, attention_mask
    return (torch.nn.functional.pad(input_ids, (extra, 0), value=pad_token_id),
            torch.nn.functional.pad(attention_mask, (extra, 0)))


def right_extended(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int,
                   multiple: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """input_ids and attention_mask [B, T] of a forward without padding, with pad tokens added as the last columns, up
    to a width that is a multiple of `multiple` (UNMASKED_WIDTH_MULTIPLE), and how many. The new columns are attended
    (mask 1, so the forward stays unmasked): under causal attention no earlier column sees them, so the real columns'
    outputs are those of the forward without them, up to the rounding of wider matrix products."""
    extra = -input_ids.shape[1] % (multiple or UNMASKED_WIDTH_MULTIPLE)
    if not extra:
        return input_ids, attention_mask, 0
    return (torch.nn.functional.pad(input_ids, (0, extra), value=pad_token_id),
            torch.nn.functional.pad(attention_mask, (0, extra), value=1), extra)


def clear_of_faulty_width(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, T], left-padded to a multiple of 128 columns where they hold padding and T is
    a FAULTY_WIDTH (a forward whose cuDNN attention backward would give NaN gradients), else unchanged."""
    modulus, remainder = FAULTY_WIDTH
    if input_ids.shape[1] % modulus != remainder or bool(attention_mask.all()):
        return input_ids, attention_mask
    return left_padded(input_ids, attention_mask, pad_token_id, multiple=modulus)


def length_groups_wanted(trainer, asked: bool | None) -> bool:
    """Whether a CBSyncGRPOTrainer groups by length (`asked`: its group_by_length; None: where its settings and model
    allow it; True: ValueError where they do not). Grouping regroups one rollout's rows among the micro-batches of one
    optimizer step, which changes any term averaged per micro-batch, and moves trimmed rows to other positions."""
    args = trainer.args
    learned_positions = has_learned_positions(trainer.accelerator.unwrap_model(trainer.model))
    wrong = [f"{name}={value!r}" for name, value, ok in (
        ("num_iterations", trainer.num_iterations, trainer.num_iterations == 1),
        ("steps_per_generation", args.steps_per_generation,
         args.steps_per_generation == args.gradient_accumulation_steps),
        ("loss_type", trainer.loss_type, trainer.loss_type != "bnpo"),
        ("top_entropy_quantile", trainer.top_entropy_quantile, trainer.top_entropy_quantile == 1.0),
        ("entropy_coef", trainer.entropy_coef, not trainer._entropy_bonus_enabled),
        ("use_adaptive_entropy", trainer.use_adaptive_entropy, not trainer.use_adaptive_entropy),
        ("router_aux_loss_coef", trainer.router_aux_loss_coef, not trainer.aux_loss_enabled),
        ("CBConfig.batch_invariant", trainer.cb_config.batch_invariant, not trainer.cb_config.batch_invariant),
        ("learned absolute positions", learned_positions, not learned_positions)) if not ok]
    if asked is None:
        return not wrong
    if asked and wrong:
        raise ValueError("group_by_length=True needs num_iterations=1, steps_per_generation equal to "
                         f"gradient_accumulation_steps ({args.gradient_accumulation_steps}), a loss_type other than "
                         "'bnpo', top_entropy_quantile=1.0, no entropy bonus and no MoE aux loss (each averaged per "
                         "micro-batch), batch_invariant=False (its forwards skip padding themselves) and a model "
                         "without learned absolute positions (trimmed rows move to other positions), got "
                         f"{', '.join(wrong)}")
    return asked


def has_learned_positions(model: torch.nn.Module) -> bool:
    """A table of absolute positions (GPT-2, OPT, ...): moving a row's tokens to other columns changes its logits."""
    return learned_position_limit(model.config.get_text_config()) is not None


def _joined(values: list):
    first = values[0]
    if isinstance(first, torch.Tensor) and first.ndim > 0:
        return torch.cat(values)
    if isinstance(first, list):
        return [item for value in values for item in value]
    return first


def _rows(value, index: torch.Tensor):
    if isinstance(value, torch.Tensor) and value.ndim > 0:
        return value[index.to(value.device)]
    if isinstance(value, list):
        return [value[i] for i in index.tolist()]
    return value
