"""LoRA in batch-invariant mode: the kernel's one fixed tiling (`invariant_tuning`), and the kernel with gradients
for the trainer's forward (`lora_linear`). Its forward is the generator's
own op in the fixed tiling (`cb_sync::lora_linear_group`, or for a base layer the kernel does not compute, the base
layer's own forward plus `cb_sync::lora_add_group`), so the trainer's outputs equal the rollout's bit for bit. Its
backward is plain torch: PEFT's gradients, `result + lora_B(lora_A(x)) * scaling` with the products in the compute
dtype.

From `fixed_large_rows` rows on the fixed tiling runs larger tiles: the same sums in the same order for every output
element, but on other tensor-core instructions, which give the same bits only where the GPU rounds a product step
alike in both. That is a property of the GPU, not of the code, so it is checked once a device and tuning, on random
operands through every path the large tiles take (`large_tiles_agree`); where any bit differs, that device keeps the
small tiles for every row count, as the generator and the trainer then both do."""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from ..tuning import LoraTuning

logger = logging.getLogger(__name__)


def invariant_tuning(enabled: bool, tuning: LoraTuning, device: torch.device) -> LoraTuning | None:
    """Batch-invariant mode's LoRA kernel tuning, the same for the generator and the trainer: one tiling for every row
    count, all base GEMMs in the kernel, the large tiles only where this device gives them the small tiles' bits.
    None where the kernel does not serve (lora_kernels=False, or off CUDA): PEFT's forward in row blocks."""
    if not (enabled and _invariant_kernel_serves(device)):
        return None
    fixed = dataclasses.replace(tuning, fixed_tiling=1)
    if fixed.fixed_large_rows and not large_tiles_agree(fixed, device):
        return dataclasses.replace(fixed, fixed_large_rows=0)
    return fixed


@functools.cache
def large_tiles_agree(tuning: LoraTuning, device: torch.device) -> bool:
    """Whether the fixed tiling gives every row the same bits from tuning.fixed_large_rows rows on as below, on this
    device: a narrow group (its K splits summed in the large tiles, and where they would be too few programs, in the
    shrink launch), a wide one (the base GEMM in the expand launch) and a base read from torch, bf16 inputs and
    weights (the only ones that take the large tiles) and fp32 adapters, the LoRA products in fp32 and in bf16,
    against the same rows in calls of fewer rows. False too where the large tiles do not fit the device."""
    from triton.runtime.errors import OutOfResources

    from ..lora import kernels
    threshold, block_n = tuning.fixed_large_rows, tuning.fixed_large_block_n
    if threshold <= 1:
        return True                                                  # every call takes the large tiles
    narrow = max(block_n, min(tuning.gemm_base_min_columns // 2, 32 * block_n))
    column_tiles = -(-narrow // block_n)
    rows = max(threshold, -(-kernels.SPLIT_BASE_MIN_PROGRAMS // column_tiles) * tuning.fixed_large_block_m)
    widths = [narrow] + ([tuning.gemm_base_min_columns] if tuning.gemm_base_min_columns <= 64 * block_n else [])
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    x = rand(rows, 2 * tuning.summed_base_split_k, dtype=torch.bfloat16)
    scale = x.shape[1] ** -0.5
    for width in widths:
        weight = rand(width, x.shape[1], scale=scale, dtype=torch.bfloat16)
        operands = (x, weight, rand(16, x.shape[1], scale=scale), rand(width, 16, scale=1e-2))
        for compute, read in ((None, False), (torch.bfloat16, False), (torch.bfloat16, True)):
            try:
                agree = _rows_agree(kernels, operands, compute, read, tuning)
            except OutOfResources as error:
                logger.info("the LoRA kernel's large tiles do not fit %s (%s)", device, error)
                agree = False
            if not agree:
                logger.info("the batch-invariant mode keeps the LoRA kernel's small tiles for every row count on %s: "
                            "its large tiles would give other bits or not run", device)
                return False
    return True


def _rows_agree(kernels, operands, compute, read_base: bool, tuning: LoraTuning) -> bool:
    """One call over all of x's rows and one of fixed_large_rows rows against calls of fewer rows, bit for bit."""
    x, weight, lora_a, lora_b = operands
    base = torch.nn.functional.linear(x, weight) if read_base else None
    threshold = tuning.fixed_large_rows

    def run(start, stop):
        if read_base:
            return kernels.lora_add_group(x[start:stop], [base[start:stop]], [lora_a], [lora_b], [2.0], compute,
                                          tuning=tuning)[0]
        return kernels.lora_linear_group(x[start:stop], [weight], [], [lora_a], [lora_b], [2.0], compute, tuning)[0]
    small = torch.cat([run(start, start + threshold - 1) for start in range(0, len(x), threshold - 1)])
    return torch.equal(run(0, len(x)), small) and torch.equal(run(0, threshold), small[:threshold])


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
