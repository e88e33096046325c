"""PEFT LoRA layers without their input cast to the adapter's dtype, where autocast makes that cast a round trip.

PEFT keeps adapter weights in fp32 and casts each LoRA layer's input to fp32 before the adapter's matmuls; under
autocast to bf16 or fp16 the matmul casts it straight back. Every bf16 or fp16 number is an fp32 number, so the round
trip changes no value, forward or backward, but it costs two copies of the input per layer and forward, and two more
casts in the backward. `input_casts(model, False)` skips the cast in layers where that holds: plain LoRA (no DoRA or
other variant) without dropout, whose dropout would otherwise compute in the input's dtype. Only for forwards under
autocast: without it a bf16 input would meet fp32 weights."""

from __future__ import annotations

import torch

from ....model_patching.swaps import attribute_set, module_list


def round_trip_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's PEFT LoRA Linear layers whose input cast autocast would undo: every adapter plain LoRA, none with
    dropout."""
    from peft.tuners.lora import Linear
    return [module for module in module_list(model)
            if isinstance(module, Linear) and not module.lora_variant
            and all(isinstance(dropout, torch.nn.Identity) for dropout in module.lora_dropout.values())]


def input_casts(model: torch.nn.Module, enabled: bool):
    """A block within which `round_trip_layers(model)` cast their inputs to the adapter dtype (enabled) or not; each
    layer's setting is restored after, so blocks nest."""
    return attribute_set(round_trip_layers(model), "cast_input_dtype_enabled", lambda layer: enabled)
