"""LoRA in batch-invariant mode: the kernel's one fixed tiling (`invariant_tuning`), and the kernel with gradients
for the trainer's forward (`lora_linear`). Its forward is the generator's
own op in the fixed tiling (`cb_sync::lora_linear_group`, or for a base layer the kernel does not compute, the base
layer's own forward plus `cb_sync::lora_add_group`), so the trainer's outputs equal the rollout's bit for bit. Its
backward is plain torch: PEFT's gradients, `result + lora_B(lora_A(x)) * scaling` with the products in the compute
dtype."""

from __future__ import annotations

import dataclasses

import torch

from ..tuning import LoraTuning


def invariant_tuning(enabled: bool, tuning: LoraTuning, device: torch.device) -> LoraTuning | None:
    """Batch-invariant mode's LoRA kernel tuning, the same for the generator and the trainer: one tiling for every row
    count, all base GEMMs in the kernel. None where the kernel does not serve (lora_kernels=False, or off CUDA):
    PEFT's forward in row blocks."""
    return dataclasses.replace(tuning, fixed_tiling=1) if enabled and _invariant_kernel_serves(device) else None


def _invariant_kernel_serves(device: torch.device) -> bool:
    return device.type == "cuda"


def lora_linear(x: torch.Tensor, base_layer: torch.nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor,
                scaling: float, compute_dtype: torch.dtype, fused_base: bool, tuning: list[int]) -> torch.Tensor:
    """base_layer(x) + scaling * (x @ lora_a^T) @ lora_b^T with PEFT's roundings, differentiable in every tensor that
    requires a gradient. fused_base: the kernel computes the base GEMM from base_layer's weight and bias (as the
    generator's did); else base_layer runs its own forward (hooks, subclasses, autocast), as in the generator."""
    from ..lora import ops  # noqa: F401  (registers the torch.ops.cb_sync LoRA ops)
    rows = x.reshape(-1, x.shape[-1])
    if fused_base:
        out = _LoraLinear.apply(rows, base_layer.weight, base_layer.bias, None, lora_a, lora_b, scaling,
                                compute_dtype, tuning)
    else:
        base = base_layer(x)
        out = _LoraLinear.apply(rows, None, None, base.reshape(-1, base.shape[-1]), lora_a, lora_b, scaling,
                                compute_dtype, tuning)
    return out.view(*x.shape[:-1], out.shape[-1])


class _LoraLinear(torch.autograd.Function):
    """The base GEMM (weight, bias) in the kernel where base_out is None, else base_out (the base layer's output,
    differentiable on its own) plus the LoRA term."""

    @staticmethod
    def forward(ctx, x, weight, bias, base_out, lora_a, lora_b, scaling, compute, tuning):
        ctx.save_for_backward(x, weight, lora_a, lora_b)
        ctx.scaling, ctx.compute, ctx.bias_dtype = scaling, compute, None if bias is None else bias.dtype
        if base_out is None:
            biases = [] if bias is None else [bias]
            return torch.ops.cb_sync.lora_linear_group(x, [weight], biases, [lora_a], [lora_b], [scaling], compute,
                                                       tuning)[0]
        return torch.ops.cb_sync.lora_add_group(x, [base_out], [lora_a], [lora_b], [scaling], compute, tuning)[0]

    @staticmethod
    def backward(ctx, grad):
        x, weight, lora_a, lora_b = ctx.saved_tensors
        need_x, need_w, need_bias, need_base, need_a, need_b = ctx.needs_input_grad[:6]
        compute = ctx.compute
        grads = [None] * 9
        with torch.autocast(grad.device.type, enabled=False):
            x_c, a_c, b_c = x.to(compute), lora_a.to(compute), lora_b.to(compute)
            grad_delta = (grad.to(compute) * ctx.scaling).to(compute)         # into lora_B's output
            grad_h = grad_delta @ b_c                                         # into lora_A's output
            if need_x:
                grads[0] = (grad_h @ a_c).to(x.dtype)
                if weight is not None:                                        # the base GEMM's share
                    grads[0] = (grad.to(weight.dtype) @ weight).to(x.dtype) + grads[0]
            if need_w:
                grads[1] = (grad.t().to(weight.dtype) @ x.to(weight.dtype))
            if need_bias:
                grads[2] = grad.sum(0).to(ctx.bias_dtype)
            if need_base:
                grads[3] = grad
            if need_a:
                grads[4] = (grad_h.t() @ x_c).to(lora_a.dtype)
            if need_b:
                grads[5] = (grad_delta.t() @ (x_c @ a_c.t()).to(compute)).to(lora_b.dtype)
        return tuple(grads)
