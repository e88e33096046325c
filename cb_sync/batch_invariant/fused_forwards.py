"""The exact mode's fused kernels (`fused_kernels`) in a model's forward: RMS norms, the MLP's SiLU(gate) x up and
the attention's rotary embeddings of the model families whose formulas the kernels compute, swapped in for the length
of a block by both the generator and the trainer, so that both sides round alike.

A swapped forward runs the kernel where it serves (CUDA, a unit stride on the last dimension) and the model's own
forward elsewhere, and inside `ops.suspended()` (the trainer's reference policy): the choice depends on the device and
layout, never on the number of rows. Other models keep their forwards, which `ops.invariant_ops` makes exact. With
gradients, the backward is the gradient of the replaced formula, recomputed in plain torch (`with_reference_grad`).
Triton is imported only where a kernel serves.

The rotary swap replaces a modeling module's function, not a module's forward: for the length of the block, another
model of that family run on CUDA by another thread computes its rotary embeddings through the kernel too (the same
formula, rounded once instead of after every op)."""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager

import torch

from ..model_patching.swaps import attribute_set, forwards_swapped
from .ops import is_suspended

MAX_NORM_WIDTH = 16384     # a row the norm kernel holds in one program's registers

# transformers classes whose forwards the kernels compute: weight * normed.to(input dtype) (Llama's) ...
LLAMA_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
# ... (normed * (1 + weight)) in fp32, then the input's dtype (Gemma's)
GEMMA_NORMS = frozenset({"GemmaRMSNorm", "Gemma2RMSNorm"})
# down_proj(act_fn(gate_proj(x)) * up_proj(x)) with act_fn SiLU
SILU_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
# modeling modules whose attention calls their module-level `apply_rotary_pos_emb` of Llama's formula
ROTARY_MODELING = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"})


def _kernel_serves(x: torch.Tensor) -> bool:
    return x.is_cuda


def _serves(*tensors: torch.Tensor) -> bool:
    return not is_suspended() and all(_kernel_serves(t) and t.stride(-1) == 1 for t in tensors)


def _norm_forward(module: torch.nn.Module):
    forward, gemma = module.forward, type(module).__name__ in GEMMA_NORMS
    eps = float(module.eps if gemma else module.variance_epsilon)

    def reference(x, weight):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        return (normed * (1.0 + weight.float())).to(x.dtype) if gemma else weight * normed.to(x.dtype)

    def kernel(x, weight):
        from .fused_kernels import rms_norm
        if gemma:
            return rms_norm(x, weight, eps, 1.0, x.dtype)
        return rms_norm(x, weight, eps, 0.0, torch.result_type(weight, x))

    def fused(x, *args, **kwargs):
        if args or kwargs or x.shape[-1] > MAX_NORM_WIDTH or not _serves(x):
            return forward(x, *args, **kwargs)
        return with_reference_grad(kernel, reference, x, module.weight)
    return _marked(fused)


def _silu_mul_reference(gate, up):
    return torch.nn.functional.silu(gate) * up


def _mlp_forward(module: torch.nn.Module):
    forward = module.forward

    def fused(x, *args, **kwargs):
        if args or kwargs or not _serves(x):
            return forward(x, *args, **kwargs)
        gate, up = module.gate_proj(x), module.up_proj(x)      # in this order: LoRA siblings share one launch
        if gate.shape != up.shape or not _serves(gate, up):
            return module.down_proj(module.act_fn(gate) * up)
        from .fused_kernels import silu_mul
        return module.down_proj(with_reference_grad(silu_mul, _silu_mul_reference, gate, up))
    return _marked(fused)


def _rotary_function(original):
    def fused(q, k, cos, sin, *args, **kwargs):
        if (args or kwargs or q.ndim != 4 or k.ndim != 4 or cos.ndim != 3 or q.shape[-1] % 2
                or cos.shape != sin.shape or cos.stride() != sin.stride() or not _serves(q, k, cos, sin)):
            return original(q, k, cos, sin, *args, **kwargs)
        from .fused_kernels import rotary
        return with_reference_grad(rotary, original, q, k, cos, sin)
    return _marked(fused)


def _marked(forward):
    forward.fused_kernels = True
    return forward


def _not_fused(forward) -> bool:
    return not getattr(forward, "fused_kernels", False)


def _swappable(module: torch.nn.Module) -> bool:
    """Not swapped already, and no accelerate hook (offloaded weights that its forward brings to the device)."""
    return _not_fused(module.forward) and getattr(module, "_hf_hook", None) is None


def _silu_mlp(module: torch.nn.Module) -> bool:
    return type(module).__name__ in SILU_MLPS and type(getattr(module, "act_fn", None)).__name__ in {"SiLU",
                                                                                                    "SiLUActivation"}


@contextmanager
def fused_forwards(modules: list[torch.nn.Module]):
    """Within the block, `modules` (a model's) of the families above run the fused kernels where they serve (see the
    module); nested blocks leave them as the outer one made them."""
    norms = [m for m in modules if type(m).__name__ in LLAMA_NORMS | GEMMA_NORMS and _swappable(m)]
    mlps = [m for m in modules if _silu_mlp(m) and _swappable(m)]
    modeling = {sys.modules[type(m).__module__] for m in modules if type(m).__name__.endswith("Attention")}
    modeling = [m for m in modeling if m.__name__.rsplit(".", 2)[-2] in ROTARY_MODELING
                and callable(getattr(m, "apply_rotary_pos_emb", None)) and _not_fused(m.apply_rotary_pos_emb)]
    with ExitStack() as stack:
        stack.enter_context(forwards_swapped(norms, _norm_forward))
        stack.enter_context(forwards_swapped(mlps, _mlp_forward))
        stack.enter_context(attribute_set(modeling, "apply_rotary_pos_emb",
                                          lambda m: _rotary_function(m.apply_rotary_pos_emb)))
        yield


def with_reference_grad(kernel, reference, *inputs: torch.Tensor):
    """kernel(*inputs), and where a gradient is wanted, reference's: the formula the kernel computes, recomputed in
    plain torch during backward."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _KernelForward.apply(kernel, reference, *inputs)
    return kernel(*inputs)


class _KernelForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel, reference, *inputs):
        ctx.reference = reference
        ctx.save_for_backward(*inputs)
        return kernel(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, needs)]
            outs = ctx.reference(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        wanted = iter(torch.autograd.grad(outs, [t for t, need in zip(leaves, needs) if need], grads,
                                          allow_unused=True))
        return (None, None, *(next(wanted) if need else None for need in needs))
