"""TRL's logprob forward as CBSyncGRPOTrainer runs it outside the exact mode.

`warmed_logps_and_entropies` is TRL's forward over whole rows; `trimmed_logps_and_entropies` (`group_by_length`)
runs each chunk of rows without the columns that are padding in all of them. Both first warm cuDNN attention for the
varieties of forward they are about to run (`attention_warmup`) and keep a forward with gradients off the widths at
which cuDNN attention's backward fails (`clear_of_fault`)."""

from __future__ import annotations

import torch

from .attention_warmup import AttentionWarmup, prefers_cudnn_attention
from .length_groups import clear_of_faulty_width, has_learned_positions, left_padded, padding_columns, right_extended


def warmed_logps_and_entropies(trl_forward, model, input_ids, attention_mask, logits_to_keep, batch_size=None, *args,
                               unwrapped: torch.nn.Module, warmup: AttentionWarmup, pad_token_id: int, **kwargs):
    """TRL's `_get_per_token_logps_and_entropies` (`trl_forward`, with TRL's arguments), after cuDNN attention's builds
    for the varieties of forward its chunks of rows will be, at a width clear of cuDNN attention's fault.

    Args:
        unwrapped: the model unwrapped (what the warm-up runs and the width rule looks at).
        warmup: the trainer's attention warm-up.
        pad_token_id: the token a widened forward's new columns hold.
    """
    input_ids, attention_mask = clear_of_fault(unwrapped, input_ids, attention_mask, pad_token_id)
    if warmup.pending(unwrapped):
        chunks = attention_mask.split(batch_size or attention_mask.size(0))
        for masked in set(torch.stack([~chunk.bool().all() for chunk in chunks]).tolist()):
            warmup.before_forward(unwrapped, masked)
    return trl_forward(model, input_ids, attention_mask, logits_to_keep, batch_size, *args, **kwargs)


def trimmed_logps_and_entropies(trl_forward, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                compute_entropy=False, compute_aux_loss=False, *, unwrapped: torch.nn.Module,
                                warmup: AttentionWarmup, pad_token_id: int, **multimodal):
    """TRL's `_get_per_token_logps_and_entropies` (`trl_forward`), each chunk of rows without the columns that are
    padding in all of them (the outputs zero there) and widened to a width that repeats across steps: on the left
    where padding is left (`left_padded`), else, where SDPA takes cuDNN attention and positions are rotary, on the
    right with columns no real one attends to (`right_extended`). Without gradients the chunks take the rows in order
    of length. Arguments as `warmed_logps_and_entropies`'s."""
    if compute_aux_loss or any(value is not None for value in multimodal.values()):
        raise NotImplementedError("group_by_length scores text-only models without an MoE aux loss")
    rows = input_ids.size(0)
    batch_size = batch_size or rows
    sort_rows = batch_size < rows and not torch.is_grad_enabled()
    order = (torch.argsort(attention_mask[:, -logits_to_keep:].sum(1), stable=True) if sort_rows
             else torch.arange(rows, device=input_ids.device))
    widen_unmasked = prefers_cudnn_attention(unwrapped)     # where cuDNN attention builds a plan per width
    logps, entropies = [], []
    for start in range(0, rows, batch_size):
        chunk = order[start:start + batch_size]
        mask = attention_mask[chunk]
        leading, trailing = padding_columns(mask, logits_to_keep)
        columns = slice(leading, input_ids.size(1) - trailing)
        ids, mask = input_ids[chunk, columns], mask[:, columns]
        masked, extra = not bool(mask.all()), 0
        if masked:                      # a forward without padding keeps SDPA's unmasked causal path
            ids, mask = clear_of_fault(unwrapped, *left_padded(ids, mask, pad_token_id), pad_token_id)
        elif widen_unmasked:
            ids, mask, extra = right_extended(ids, mask, pad_token_id)
        warmup.before_forward(unwrapped, masked)
        kept = logits_to_keep - trailing
        chunk_logps, chunk_entropies, _ = trl_forward(model, ids, mask, kept + extra, compute_entropy=compute_entropy)
        logps.append(torch.nn.functional.pad(chunk_logps[:, :kept], (0, trailing)))
        if compute_entropy:
            entropies.append(torch.nn.functional.pad(chunk_entropies[:, :kept], (0, trailing)))
    logps, entropies = torch.cat(logps), torch.cat(entropies) if compute_entropy else None
    if sort_rows:
        unsorted = torch.argsort(order)
        logps, entropies = logps[unsorted], entropies[unsorted] if compute_entropy else None
    return logps, entropies, None


def clear_of_fault(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward with gradients through cuDNN attention, widened where its width would give NaN gradients
    (`length_groups.clear_of_faulty_width`); models with learned absolute positions keep theirs (their logprobs
    would change)."""
    if not torch.is_grad_enabled() or not prefers_cudnn_attention(model) or has_learned_positions(model):
        return input_ids, attention_mask
    return clear_of_faulty_width(input_ids, attention_mask, pad_token_id)
