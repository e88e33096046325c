"""The trainer's side of batch-invariant mode: per-token logprobs of full sequences that equal, bit for bit, the
logprobs `SyncCBDriver` returned when it sampled them with `CBConfig(batch_invariant=True)`.

The model runs its own forward (with gradients) under `batch_invariant.invariant_ops()` and the generator's fused
kernels (`fused_forwards`), its attention through the generator's row-invariant kernel (`training_attention`) at the
tokens' own positions (padding removed), and the logprobs come from the sampler's op over logits / temperature."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..lora import lora_kernels as lora_forwards
from ..model_patching.generation_mode import attention_implementations, restore_attention
from ..model_patching.swaps import base_model, forwards_swapped, module_list
from ..sampling import chosen_logprobs
from ..tuning import LoraTuning
from .fused_forwards import fused_forwards
from .lora import invariant_tuning, lora_linear
from .ops import invariant_ops, suspended
from .training_attention import INVARIANT_IMPLEMENTATION, positions_from_mask

_OUTSIDE_ATTENTION: dict[int, list] = {}   # id(config) -> `attention_implementations` outside `invariant_training`


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP / DataParallel and torch.compile wrappers (a trainer may hand its wrapped model)."""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


@contextmanager
def invariant_training(model: torch.nn.Module, lora_kernels: bool = True, tuning: LoraTuning = LoraTuning()):
    """Within the block, the model's forwards (with the cb_positions / cb_block_size kwargs of `invariant_logits`)
    run batch-invariantly: also a forward recomputed by gradient checkpointing during backward, which must save what
    the first one saved. PEFT LoRA layers run the generator's LoRA kernel where its driver does (lora_kernels and
    tuning: the generator's CBConfig's). The attention implementation is restored after (model may be wrapped, e.g.
    in DDP)."""
    model = unwrapped(model)
    config = base_model(model).config
    previous = attention_implementations(config)
    modules = module_list(model)
    device = base_model(model).get_input_embeddings().weight.device
    lora_tuning = invariant_tuning(lora_kernels, tuning, device)
    outermost = id(config) not in _OUTSIDE_ATTENTION
    try:
        if outermost:
            _OUTSIDE_ATTENTION[id(config)] = previous
        config._attn_implementation = INVARIANT_IMPLEMENTATION
        # backward runs outside any torch function mode, so the modules gradient checkpointing recomputes enter it
        # themselves: every leaf module (linear layers, norms; the rest of a layer is elementwise or this attention)
        leaves = [m for m in modules if not m._modules]
        with (fused_forwards(modules), forwards_swapped(leaves, lambda leaf: _in_invariant_ops(leaf.forward)),
              invariant_ops(), lora_forwards(model, lora_tuning is not None, modules, lora_tuning or tuning,
                                             lora_linear)):
            yield
    finally:
        restore_attention(previous)
        if outermost:
            _OUTSIDE_ATTENTION.pop(id(config), None)


@contextmanager
def default_forward(model: torch.nn.Module):
    """Within the block, forwards of `model` run as in the default mode also inside an `invariant_training` block:
    its attention implementation from outside that block, every op as it is (`batch_invariant.suspended`); PEFT
    layers with an active adapter keep the generator's LoRA kernel. For forwards whose bits need not match the
    generator's (the trainer's reference policy)."""
    config = base_model(unwrapped(model)).config
    previous = attention_implementations(config)
    try:
        restore_attention(_OUTSIDE_ATTENTION.get(id(config), previous))
        with suspended():
            yield
    finally:
        restore_attention(previous)


def _in_invariant_ops(forward):
    def wrapped(*args, **kwargs):
        with invariant_ops():
            return forward(*args, **kwargs)
    return wrapped


def invariant_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     logits_to_keep: int, block_size: int, lora_kernels: bool = True,
                     tuning: LoraTuning = LoraTuning()) -> torch.Tensor:
    """Logits [B, logits_to_keep, V] predicting the last logits_to_keep tokens of each row, batch-invariantly
    (input_ids / attention_mask [B, T], left- or right-padded; block_size, lora_kernels and tuning: the generator's
    CBConfig's block_size, lora_kernels and tuning.lora)."""
    positions = positions_from_mask(attention_mask)
    with invariant_training(model, lora_kernels, tuning):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions.clamp(min=0),
                       cb_positions=positions, cb_block_size=block_size, logits_to_keep=logits_to_keep + 1,
                       use_cache=False).logits
    return logits[:, :-1]


def invariant_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, L] logprobs of tokens [B, L] under log_softmax(logits [B, L, V] / temperature), as the sampler computes
    them (a temperature column in fp32, the log_softmax in invariant row blocks). Differentiable; for backward it keeps
    the logits alone, not fp32 copies of [rows, vocab] (`_ChosenLogprobs`)."""
    rows = logits.reshape(-1, logits.shape[-1])
    temperatures = torch.full((rows.shape[0], 1), temperature, dtype=torch.float32, device=rows.device)
    return _ChosenLogprobs.apply(rows, tokens.reshape(-1), temperatures).view(tokens.shape)


class _ChosenLogprobs(torch.autograd.Function):
    """chosen_logprobs(rows.float() / temperatures, tokens), its gradient (onehot - softmax) / temperature
    recomputed in backward."""

    @staticmethod
    def forward(ctx, rows, tokens, temperatures):
        ctx.save_for_backward(rows, tokens, temperatures)
        with invariant_ops():
            return chosen_logprobs(rows.float() / temperatures, tokens)

    @staticmethod
    def backward(ctx, grad):
        rows, tokens, temperatures = ctx.saved_tensors
        grad_scaled = torch.softmax(rows.float() / temperatures, dim=-1).mul_(-grad[:, None])
        grad_scaled.scatter_add_(1, tokens[:, None], grad[:, None])
        return grad_scaled.div_(temperatures).to(rows.dtype), None, None
