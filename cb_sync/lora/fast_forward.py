"""Swap PEFT LoRA Linear forwards for the Triton LoRA kernel while cb_sync generates, and put them back.

The swapped forward reads the very `lora_A` / `lora_B` parameters the trainer updates (no copy) and computes
PEFT's function; anything it does not cover (merged or disabled adapters, DoRA and other variants, LoRA
bias, active dropout, non-Linear base layers, more than MAX_ROWS rows, extra arguments) goes to PEFT's own
forward.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

MAX_ROWS = 256   # decode-sized steps; larger (prefill) steps are GEMM-bound and keep PEFT's path


def _lora_linears(model: torch.nn.Module):
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, Linear) and isinstance(m.base_layer, torch.nn.Linear)]


def _kernel_adapters(module, x: torch.Tensor):
    """(A, B, scaling) of each active adapter when the kernel computes PEFT's result exactly, else None."""
    if module.disable_adapters or module.merged or x.shape[:-1].numel() > MAX_ROWS:
        return None
    adapters = []
    for name in module.active_adapters:
        if name not in module.lora_A.keys():
            continue
        lora_a, lora_b = module.lora_A[name], module.lora_B[name]
        dropout_active = module.training and not isinstance(module.lora_dropout[name], torch.nn.Identity)
        variant = name in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(name, False)
        if (variant or dropout_active or getattr(lora_b, "bias", None) is not None
                or lora_a.weight.dtype != lora_b.weight.dtype):
            return None
        adapters.append((lora_a.weight, lora_b.weight, module.scaling[name]))
    return adapters


def _kernel_forward(module, peft_forward):
    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapters = None if args or kwargs else _kernel_adapters(module, x)
        if adapters is None:
            return peft_forward(x, *args, **kwargs)
        result = module.base_layer(x)
        rows_in, rows_out = x.reshape(-1, x.shape[-1]), result.reshape(-1, result.shape[-1])
        for lora_a, lora_b, scaling in adapters:
            rows_out = torch.ops.cb_sync.lora_add(rows_in, rows_out, lora_a, lora_b, scaling)
        return rows_out.view(result.shape)
    return forward


@contextmanager
def lora_kernels(model: torch.nn.Module, enabled: bool = True):
    """Within the block, PEFT LoRA Linear modules of `model` run the Triton LoRA kernel where it applies."""
    modules = _lora_linears(model) if enabled else []
    if modules:
        from cb_sync.lora import ops  # noqa: F401  (registers torch.ops.cb_sync.lora_add)
    patched = [(module, module.__dict__.get("forward")) for module in modules]   # keep e.g. accelerate hooks
    for module, _ in patched:
        module.forward = _kernel_forward(module, module.forward)
    try:
        yield
    finally:
        for module, previous in patched:
            if previous is None:
                del module.forward
            else:
                module.forward = previous
