"""LoRA at decode speed: a Triton kernel for PEFT LoRA Linear layers, swapped in while cb_sync generates."""

from .peft_forward import kernel_row_limit, lora_kernels

__all__ = ["kernel_row_limit", "lora_kernels"]
