"""The trainer's side of batch-invariant mode: per-token logprobs of full sequences that equal, bit for bit, the
logprobs `SyncCBDriver` returned when it sampled them with `CBConfig(batch_invariant=True)`.

The model runs its own forward (with gradients) under `batch_invariant.invariant_ops()` and the generator's fused
kernels (`fused_forwards`) over the batch's real tokens packed into one row (`packing`), its attention through the
generator's row-invariant kernel (`training_attention`) at the tokens' own positions, and the logprobs come from the
sampler's op over logits / temperature, a chunk of rows at a time (`logprobs`)."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..lora import lora_kernels as lora_forwards
from ..model_patching.generation_mode import attention_implementations, restore_attention
from ..model_patching.swaps import base_model, forwards_swapped, module_list
from ..tuning import LoraTuning
from .fused_forwards import fused_forwards
from .logprobs import token_logprobs
from .lora import invariant_tuning, lora_linear
from .ops import invariant_ops, suspended
from .packing import packed_batch
from .training_attention import INVARIANT_IMPLEMENTATION

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
    """Within the block, the model's forwards (with the cb_pages kwarg of `invariant_token_logprobs`)
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


def invariant_token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             logits_to_keep: int, temperature: float, block_size: int, lora_kernels: bool = True,
                             tuning: LoraTuning = LoraTuning(), entropies: bool = False,
                             entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs [B, logits_to_keep] of the last logits_to_keep tokens of each row, batch-invariantly: the
    generator's bits for every real token that follows a real one, 0 elsewhere. The batch is packed (`packing`):
    the forward computes no padding and the LM head only the scored tokens' rows.

    Args:
        model: the policy (maybe wrapped), run with gradients where they are enabled.
        input_ids, attention_mask: [B, T], left- or right-padded.
        logits_to_keep: the completion's columns, at the end of each row.
        temperature: the sampling temperature the logprobs are taken at.
        block_size, lora_kernels, tuning: the generator's CBConfig's block_size, lora_kernels and tuning.lora.
        entropies: also return the entropies of the same distributions ([B, logits_to_keep], 0 where not scored).
        entropy_grad: the entropies carry gradients (an entropy bonus in the loss).

    Returns:
        (logprobs, entropies or None), fp32.
    """
    packed = packed_batch(input_ids, attention_mask, logits_to_keep, block_size)
    with invariant_training(model, lora_kernels, tuning):
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, cb_pages=packed.pages,
                       logits_to_keep=packed.predicting, use_cache=False).logits[0]
    logps, ents = token_logprobs(logits, packed.targets, temperature, entropies, entropy_grad)
    return packed.unpacked(logps), packed.unpacked(ents) if entropies else None
