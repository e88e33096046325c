"""The exact mode (`CBConfig(batch_invariant=True)`) on CBSyncGRPOTrainer's side.

The rollouts and the trainer's own forwards of the policy (the loss's and TRL's old logps; also the forward that
gradient checkpointing recomputes) run batch-invariantly (`cb_sync.batch_invariant.trainer`): the generator's logprobs
equal the trainer's bit for bit, so the logprob gap is exactly 0 and every importance ratio exactly 1. The reference
policy's forward enters the KL term only, so it takes the default path (`scores_reference`). The trained model may
hold no dropout, which the rollout does not run (`check_training`).

Where TRL would score a rollout again before training on it (its old logps: num_iterations > 1, more micro-batches a
rollout than an optimizer step takes, or the importance-sampling correction), that forward would only recompute the
generator's logprobs at the same weights, bit for bit: `RolloutLogprobs` hands TRL the generator's instead."""

from __future__ import annotations

import torch

from ...batch_invariant.ops import check_model
from ...batch_invariant.trainer import invariant_token_logprobs, invariant_training
from ...config import CBConfig
from ...model_patching.swaps import base_model, module_list


def check_training(model: torch.nn.Module) -> None:
    """ValueError where the training forward cannot match the rollout's: a layer the exact mode does not cover
    (`check_model`), or dropout (a module's, or a rate in the model's config that its forward applies)."""
    check_model(model)
    dropouts = sorted({f"{type(m).__name__}(p={m.p})" for m in model.modules()
                       if isinstance(m, torch.nn.Dropout) and m.p > 0})
    config = base_model(model).config.get_text_config()   # models that call F.dropout with their config's rates
    dropouts += sorted(f"{key}={value}" for key, value in config.to_dict().items()
                       if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0)
    if dropouts:
        raise ValueError("CBConfig(batch_invariant=True) needs a training forward without dropout (the rollout runs "
                         f"none), got {', '.join(dropouts)}: set lora_dropout=0 (and the model's dropout to 0)")


def training_forwards(model: torch.nn.Module, config: CBConfig):
    """A block within which a training step's forwards of `model` (unwrapped) run batch-invariantly, also the one
    gradient checkpointing recomputes during the backward."""
    return invariant_training(model, config.lora_kernels, config.tuning.lora)


def scores_reference(model: torch.nn.Module, unwrapped: torch.nn.Module, ref_model: torch.nn.Module | None) -> bool:
    """Whether a logprob forward scores TRL's reference policy: without gradients (as TRL always scores it), its
    ref_model, or the PEFT model with its adapters disabled or its "ref" adapter active. A forward with gradients is
    the policy's, whatever the adapters' state.

    Args:
        model: the model TRL passes to the forward (maybe wrapped).
        unwrapped: the same model unwrapped.
        ref_model: TRL's reference model (None: the PEFT model with its adapters disabled, or none).
    """
    if torch.is_grad_enabled():
        return False
    if ref_model is not None and model is ref_model:
        return True
    active = getattr(unwrapped, "active_adapter", None)
    if active == "ref" or (isinstance(active, (list, tuple)) and "ref" in active):
        return True
    return any(getattr(module, "disable_adapters", False) for module in adapter_layers(unwrapped))


def logps_and_entropies(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        logits_to_keep: int, batch_size: int | None = None, compute_entropy: bool = False,
                        compute_aux_loss: bool = False, *, config: CBConfig, temperature: float, autocast,
                        entropy_with_grad: bool, **multimodal):
    """TRL's `_get_per_token_logps_and_entropies` in the exact mode: the logprobs of the generator's kernels and op,
    equal to the rollout's bit for bit, and entropies from the same logits; 0 at the columns TRL masks (padding).

    Args:
        model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss: TRL's.
        config: the trainer's CBConfig (its LoRA kernels and their tuning).
        temperature: the sampling temperature the logprobs are taken at.
        autocast: the accelerator's autocast (a callable giving a context manager), as TRL's forwards run under it.
        entropy_with_grad: whether entropies carry gradients where the forward does (TRL's entropy bonus).

    Returns:
        (logps [B, logits_to_keep], entropies or None, None): TRL's triple, without an aux loss.
    """
    if compute_aux_loss or any(value is not None for value in multimodal.values()):
        raise NotImplementedError("batch-invariant mode scores text-only models without an MoE aux loss")
    batch_size = batch_size or input_ids.size(0)
    logps, entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
        with autocast():
            chunk_logps, chunk_entropies = invariant_token_logprobs(
                model, ids, mask, logits_to_keep, temperature, config.block_size, config.lora_kernels,
                config.tuning.lora, entropies=compute_entropy, entropy_grad=entropy_with_grad)
        logps.append(chunk_logps)
        entropies.append(chunk_entropies)
    return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None


class RolloutLogprobs:
    """The generator's logprobs of the rollout being scored, kept from TRL's `_generate` until TRL asks for its old
    logps (a forward of the policy without gradients), which they are in the exact mode. Not kept for a rollout with
    tool calls (tool results are not the generator's tokens)."""

    def __init__(self):
        self._pending: list | None = None
        self.taken = False       # the rollout's old logps are the generator's

    def keep(self, logprobs: list | None, tool_mask: list | None) -> None:
        """A new rollout's per-completion logprobs (TRL's `_generate`'s) and tool masks."""
        self._pending = logprobs if tool_mask is None else None
        self.taken = False

    def take(self, rows: int, logits_to_keep: int, device: torch.device) -> torch.Tensor | None:
        """[rows, logits_to_keep] old logps (0 past each completion) where the kept rollout has that many rows that
        fit, once; else None (the forward runs)."""
        logprobs, self._pending = self._pending, None
        if logprobs is None or len(logprobs) != rows or any(len(row) > logits_to_keep for row in logprobs):
            return None
        old = torch.zeros(rows, logits_to_keep, dtype=torch.float32)
        for i, row in enumerate(logprobs):
            old[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
        self.taken = True
        return old.to(device)

    def clear(self) -> None:
        self._pending = None


def adapter_layers(model: torch.nn.Module):
    """PEFT's tuner layers of `model` (LoRA's and other adapters'; none where PEFT is not installed)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return
    yield from (module for module in module_list(model) if isinstance(module, BaseTunerLayer))
