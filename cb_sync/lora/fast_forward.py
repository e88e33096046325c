"""Swap PEFT LoRA Linear forwards for the Triton LoRA kernel while cb_sync generates, and put them back.

The swapped forward reads the very `lora_A` / `lora_B` parameters the trainer updates (no copy) and computes
PEFT's function, also under autocast; anything it does not cover goes to PEFT's own forward: several active
adapters, merged or disabled adapters, DoRA and other variants, LoRA bias, active dropout, hooked modules
(accelerate offload), weights on another device, ranks above MAX_RANK, more than MAX_ROWS rows, extra
arguments, gradients to compute, non-Linear base layers.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

MAX_ROWS = 256   # decode-sized steps; larger (prefill) steps are GEMM-bound and keep PEFT's path
MAX_RANK = 128   # the kernel holds a row tile's whole rank in registers


def _lora_linears(model: torch.nn.Module):
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, Linear) and isinstance(m.base_layer, torch.nn.Linear)]


def _hooked(module: torch.nn.Module) -> bool:
    return bool(getattr(module, "_hf_hook", None) or module._forward_hooks or module._forward_pre_hooks)


def _kernel_adapter(module, x: torch.Tensor):
    """(A, B, scaling, compute dtype) of the one active adapter when the kernel computes PEFT's result, else None.

    Under autocast PEFT's A and B products run in the autocast dtype, so the kernel rounds to it.
    """
    names = [name for name in module.active_adapters if name in module.lora_A.keys()]
    if (len(names) != 1 or module.disable_adapters or module.merged or x.shape[:-1].numel() > MAX_ROWS
            or _hooked(module) or not getattr(module, "cast_input_dtype_enabled", True)):
        return None
    name = names[0]
    lora_a, lora_b = module.lora_A[name], module.lora_B[name]
    weights = (lora_a.weight, lora_b.weight)
    dropout_active = module.training and not isinstance(module.lora_dropout[name], torch.nn.Identity)
    variant = name in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(name, False)
    if (variant or dropout_active or getattr(lora_b, "bias", None) is not None or _hooked(lora_a) or _hooked(lora_b)
            or weights[0].dtype != weights[1].dtype or any(w.device != x.device for w in weights)
            or weights[0].shape[0] > MAX_RANK or (torch.is_grad_enabled() and any(w.requires_grad for w in weights))):
        return None
    device = x.device.type
    compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weights[0].dtype
    return weights[0], weights[1], module.scaling[name], compute


def _kernel_forward(module, peft_forward):
    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapter = None if args or kwargs else _kernel_adapter(module, x)
        if adapter is None:
            return peft_forward(x, *args, **kwargs)
        result = module.base_layer(x)
        out = torch.ops.cb_sync.lora_add(x.reshape(-1, x.shape[-1]), result.reshape(-1, result.shape[-1]), *adapter)
        return out.view(result.shape)
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
