"""The LoRA kernel as an opaque `torch.library` custom op, so `torch.compile` calls it without tracing in."""

import torch

from cb_sync.lora import kernels


@torch.library.custom_op("cb_sync::lora_add", mutates_args=())
def lora_add(x: torch.Tensor, base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scaling: float, compute_dtype: torch.dtype) -> torch.Tensor:
    """base + scaling * B(A(x)) with PEFT's roundings; see `kernels.lora_add`."""
    return kernels.lora_add(x, base, lora_a, lora_b, scaling, compute_dtype)


@lora_add.register_fake
def _(x, base, lora_a, lora_b, scaling, compute_dtype) -> torch.Tensor:
    return torch.empty_like(base)
