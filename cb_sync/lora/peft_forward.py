"""Swap PEFT LoRA Linear forwards for the Triton LoRA kernel while cb_sync generates, and put them back.

The swapped forward reads the very `lora_A` / `lora_B` parameters the trainer updates (no copy) and computes
PEFT's function, also under autocast; anything it does not cover goes to PEFT's own forward: several active
adapters, merged or disabled adapters, DoRA and other variants, LoRA bias, active dropout, hooked modules
(accelerate offload), weights on another device, ranks above MAX_RANK, extra arguments, gradients to compute
(except in the fixed tiling of batch-invariant mode, where the caller passes a differentiable op), non-Linear
base layers, eager steps of the tuning's host-bound sizes, and steps too large for the kernel's int32
offsets (`kernel_row_limit`: a compiled step has no size test, so its caller keeps it within that bound).

Projections that read one input (SHARED_INPUT: q/k/v, gate/up) share one kernel launch pair: the first one called
computes its siblings' outputs too (their base layers and LoRA), and each sibling called next on the same tensor
returns its output instead of computing it. For plain nn.Linear base layers the kernel also computes the base
GEMMs where it is faster (`LoraTuning`'s fused_base_* bounds; decided inside the op, so torch.compile has no size
to guard).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..model_patching.swaps import base_model, forwards_swapped, module_list
from ..tuning import LoraTuning

MAX_RANK = 128   # the kernel holds a row tile's whole rank in registers
KERNEL_MAX_ELEMENTS = torch.iinfo(torch.int32).max   # rows x features within reach of the kernel's int32 offsets
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# HF names of projections that read one tensor, called in a row by the attention and MLP forwards of Llama, Qwen,
# Mistral, Gemma and the like
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _version(x: torch.Tensor):
    """x's in-place version counter, or None where there is none to read (torch.compile, inference tensors)."""
    return None if torch.compiler.is_compiling() or x.is_inference() else x._version


class KernelAdapter(NamedTuple):
    """What the kernel needs of a layer's one active adapter (PEFT's lora_A and lora_B weights)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float
    compute_dtype: torch.dtype      # the A and B products' dtype: the weights', or autocast's


class _Kept(NamedTuple):
    """A member's output computed ahead, with the input and adapter it was computed from."""

    input: torch.Tensor
    version: int | None
    output: torch.Tensor
    adapter: KernelAdapter


class _SharedInput:
    """Projections that read one input. The first one called computes every member's output with one kernel pair
    and keeps the others' outputs, each with the adapter it used; a member called next on that same, unmodified
    tensor with that same adapter takes its own output instead of computing it. (A tensor changed in place between
    the calls is detected where it has a version counter: not under torch.compile, nor for inference tensors.)"""

    def __init__(self, modules: list):
        self.modules = modules
        self.kept: dict[int, _Kept] = {}       # member index -> its output computed ahead; emptied as members take

    def take(self, index: int, x: torch.Tensor, adapter: KernelAdapter):
        kept = self.kept.pop(index, None)
        if kept is None or kept.input is not x or kept.version != _version(x):
            return None
        same = (kept.adapter.lora_a is adapter.lora_a and kept.adapter.lora_b is adapter.lora_b
                and kept.adapter.scaling == adapter.scaling and kept.adapter.compute_dtype == adapter.compute_dtype)
        return kept.output if same else None

    def keep(self, x: torch.Tensor, outputs: dict, adapters: dict):
        self.kept = {i: _Kept(x, _version(x), out, adapters[i]) for i, out in outputs.items()}


def _lora_groups(modules: list) -> dict:
    """id(module) -> (module, group, index) for each PEFT LoRA Linear over an nn.Linear among `modules`: siblings
    named in SHARED_INPUT (children of one parent) with one input width share a group, the rest are alone."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return {}
    lora = {id(m): m for m in modules if isinstance(m, Linear) and isinstance(m.base_layer, torch.nn.Linear)}
    placed = {}
    for parent in modules:
        children = parent._modules
        for siblings in SHARED_INPUT if children else ():
            members = [children[name] for name in siblings if name in children]
            members = [m for m in members if id(m) in lora and id(m) not in placed]
            if len(members) > 1 and len({m.base_layer.in_features for m in members}) == 1:
                group = _SharedInput(members)
                placed.update({id(m): (m, group, i) for i, m in enumerate(members)})
    for key, module in lora.items():
        if key not in placed:
            placed[key] = (module, _SharedInput([module]), 0)
    return placed


def _hooked(module: torch.nn.Module) -> bool:
    return bool(getattr(module, "_hf_hook", None) or module._forward_hooks or module._forward_pre_hooks)


def _kernel_adapter(module, x: torch.Tensor, tuning: LoraTuning, differentiable) -> KernelAdapter | None:
    """The one active adapter when the kernel computes PEFT's result, else None (also where gradients are wanted and
    no differentiable op was given: the kernel's ops have no backward).

    Under autocast PEFT's A and B products run in the autocast dtype, so the kernel rounds to it.
    """
    names = [name for name in module.active_adapters if name in module.lora_A.keys()]
    base = module.base_layer
    # compiled: no size test to guard on (see kernel_row_limit); fixed tiling: no choice by size at all
    if not torch.compiler.is_compiling() and not tuning.fixed_tiling:
        rows = x.shape[:-1].numel()
        host_bound = tuning.host_bound_min_rows <= rows < tuning.host_bound_max_rows
        if host_bound or rows * max(base.in_features, base.out_features) > KERNEL_MAX_ELEMENTS:
            return None
    if (len(names) != 1 or module.disable_adapters or module.merged or _hooked(module)
            or not getattr(module, "cast_input_dtype_enabled", True)):
        return None
    name = names[0]
    lora_a, lora_b = module.lora_A[name], module.lora_B[name]
    weights = (lora_a.weight, lora_b.weight)
    dropout_active = module.training and not isinstance(module.lora_dropout[name], torch.nn.Identity)
    variant = name in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(name, False)
    if (variant or dropout_active or getattr(lora_b, "bias", None) is not None or _hooked(lora_a) or _hooked(lora_b)
            or weights[0].dtype != weights[1].dtype or weights[0].dtype not in KERNEL_DTYPES
            or x.dtype not in KERNEL_DTYPES or any(w.device != x.device for w in weights)
            or weights[0].shape[1] != x.shape[-1] or weights[0].shape[0] > MAX_RANK
            or (_wants_grad(x, *weights, base.weight, base.bias) and differentiable is None)):
        return None
    device = x.device.type
    compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weights[0].dtype
    return KernelAdapter(weights[0], weights[1], module.scaling[name], compute)


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _base_fusable(layers: list, x: torch.Tensor) -> bool:
    """Whether the kernel may compute the base layers too (it does where it is faster: `kernels.lora_linear_group`):
    plain nn.Linear layers (a subclass may compute something else) with plain weights and biases of x's dtype and
    device, biases on all layers or none, no hooks, and no autocast to another dtype (autocast to x's dtype, as
    accelerate's mixed-precision forward of a bf16 model, computes the same base GEMM)."""
    device = x.device.type
    tensors = [t for layer in layers for t in (layer.weight, layer.bias) if t is not None]
    return (all(type(layer) is torch.nn.Linear and type(layer.weight) is torch.nn.Parameter for layer in layers)
            and (not torch.is_autocast_enabled(device) or torch.get_autocast_dtype(device) == x.dtype)
            and all(t.dtype == x.dtype and t.device == x.device for t in tensors)
            and len({layer.bias is None for layer in layers}) == 1 and not any(_hooked(layer) for layer in layers))


def _base_kind(layer, x: torch.Tensor) -> tuple[bool, bool]:
    """What decides a layer's base path: in the fixed tiling only layers of one kind share a launch, so that each
    projection's base is computed as it would be alone (as the trainer's differentiable op computes it)."""
    return _base_fusable([layer], x), layer.bias is None


def _kernel_forward(module, peft_forward, group: _SharedInput, index: int, tuning: LoraTuning, differentiable):
    ints = tuning.ints()

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapter = None if args or kwargs else _kernel_adapter(module, x, tuning, differentiable)
        if adapter is None:
            return peft_forward(x, *args, **kwargs)
        base = module.base_layer
        if differentiable is not None and _wants_grad(x, adapter.lora_a, adapter.lora_b, base.weight, base.bias):
            # a batch-invariant trainer's forward: this projection alone, differentiable
            return differentiable(x, base, *adapter, _base_fusable([base], x), ints)
        kept = group.take(index, x, adapter)
        if kept is not None:
            return kept
        members = {index: adapter}
        base_kind = _base_kind(base, x) if tuning.fixed_tiling else None
        for other_index, other in enumerate(group.modules):
            other_adapter = None if other_index == index else _kernel_adapter(other, x, tuning, differentiable)
            same_dtypes = other_adapter is not None and other_adapter.lora_a.dtype == adapter.lora_a.dtype
            if same_dtypes and other_adapter.compute_dtype == adapter.compute_dtype and (
                    base_kind is None or _base_kind(other.base_layer, x) == base_kind):
                members[other_index] = other_adapter
        lora = ([a.lora_a for a in members.values()], [a.lora_b for a in members.values()],
                [a.scaling for a in members.values()])
        layers = [group.modules[i].base_layer for i in members]
        rows = x.reshape(-1, x.shape[-1])
        if _base_fusable(layers, x):
            biases = [layer.bias for layer in layers if layer.bias is not None]
            outs = torch.ops.cb_sync.lora_linear_group(rows, [layer.weight for layer in layers], biases, *lora,
                                                       adapter.compute_dtype, ints)
        else:
            results = [layer(x) for layer in layers]
            outs = torch.ops.cb_sync.lora_add_group(rows, [r.reshape(-1, r.shape[-1]) for r in results], *lora,
                                                    adapter.compute_dtype, ints)
        outs = {i: out.view(*x.shape[:-1], out.shape[-1]) for i, out in zip(members, outs)}
        if len(members) > 1:
            group.keep(x, {i: out for i, out in outs.items() if i != index}, members)
        return outs[index]
    return forward



def lora_kernels(model: torch.nn.Module, enabled: bool = True, modules: list | None = None,
                 tuning: LoraTuning = LoraTuning(), differentiable=None):
    """Within the block, PEFT LoRA Linear modules of `model` run the Triton LoRA kernel where it applies (modules:
    the model's modules if already walked, see `model_patching.swaps.module_list`). differentiable: the op a forward
    that needs gradients calls in the fixed tiling (`batch_invariant.lora.lora_linear`); None: PEFT's forward."""
    groups = _lora_groups(module_list(model) if modules is None else modules) if enabled else {}
    if groups:
        from cb_sync.lora import ops  # noqa: F401  (registers the torch.ops.cb_sync LoRA ops)
    return forwards_swapped([module for module, _, _ in groups.values()],
                            lambda module: _kernel_forward(module, module.forward, *groups[id(module)][1:], tuning,
                                                           differentiable))


def kernel_row_limit(model: torch.nn.Module) -> int:
    """The most rows a compiled step may feed the kernel: within its int32 offsets for the widest Linear layer
    (the output embeddings left out: they see the kept rows only)."""
    output = base_model(model).get_output_embeddings()
    head = {id(m) for m in output.modules()} if output is not None else set()
    widest = max((max(m.in_features, m.out_features) for m in module_list(model)
                  if isinstance(m, torch.nn.Linear) and id(m) not in head), default=1)
    return KERNEL_MAX_ELEMENTS // widest
