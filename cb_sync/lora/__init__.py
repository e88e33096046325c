"""LoRA at decode speed: a Triton kernel for PEFT LoRA Linear layers, swapped in while cb_sync generates."""

from .fast_forward import invariant_tuning, kernel_row_limit, lora_kernels

__all__ = ["invariant_tuning", "kernel_row_limit", "lora_kernels"]
