"""The LoRA kernel as an opaque `torch.library` custom op, so `torch.compile` calls it without tracing in."""

import functools

import torch

from cb_sync.lora import kernels
from cb_sync.tuning import LoraTuning


@functools.cache
def _tuning(ints: tuple[int, ...]) -> LoraTuning:
    """The LoraTuning of these ints, built (and validated) once: the ops are called on every LoRA layer's forward."""
    return LoraTuning(*ints)


@torch.library.custom_op("cb_sync::lora_add_group", mutates_args=())
def lora_add_group(x: torch.Tensor, bases: list[torch.Tensor], lora_as: list[torch.Tensor], lora_bs: list[torch.Tensor],
                   scalings: list[float], compute_dtype: torch.dtype, tuning: list[int]) -> list[torch.Tensor]:
    """bases[i] + scalings[i] * B_i(A_i(x)); see `kernels.lora_add_group` (tuning: a LoraTuning's ints)."""
    return kernels.lora_add_group(x, bases, lora_as, lora_bs, scalings, compute_dtype, tuning=_tuning(tuple(tuning)))


@lora_add_group.register_fake
def _(x, bases, lora_as, lora_bs, scalings, compute_dtype, tuning) -> list[torch.Tensor]:
    return [torch.empty(base.shape, dtype=base.dtype, device=base.device) for base in bases]


@torch.library.custom_op("cb_sync::lora_linear_group", mutates_args=())
def lora_linear_group(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor],
                      lora_as: list[torch.Tensor], lora_bs: list[torch.Tensor], scalings: list[float],
                      compute_dtype: torch.dtype, tuning: list[int]) -> list[torch.Tensor]:
    """x @ weights[i]^T (+ biases[i]) + scalings[i] * B_i(A_i(x)); see `kernels.lora_linear_group`."""
    return kernels.lora_linear_group(x, weights, biases, lora_as, lora_bs, scalings, compute_dtype,
                                     _tuning(tuple(tuning)))


@lora_linear_group.register_fake
def _(x, weights, biases, lora_as, lora_bs, scalings, compute_dtype, tuning) -> list[torch.Tensor]:
    return [torch.empty((x.shape[0], w.shape[0]), dtype=w.dtype, device=w.device) for w in weights]
