"""The trained model's decoder layers compiled one by one (regional compilation) for a training step's forwards.

A training step's forwards and backward are host-bound at small batches: a 4B model's eager step issues ~16k kernels,
most of them elementwise (RMSNorm in fp32, rotary, residual adds, SiLU, LoRA's scaling and adds). `torch.compile` of
each decoder layer's call fuses them. The layers of one class share one code object, so they share its compiled
graphs: one compile per variety of call (gradients or none, padding or none, adapter on or off), reused by every
layer, instead of the whole model's compile, which at 4B takes minutes per variety. Shapes are dynamic from the
first call, so new widths do not recompile. The values are those of the fused kernels: equal to eager ones up to
rounding, not bit for bit.

`CompiledLayers.switched(model, on)` sets each layer's compiled call (on) or none (off) for a block and restores what
was there after, so blocks nest: the trainer switches the layers on for a training step and off again for its
rollout, whose own compiled decode step traces the layers as they were when it was compiled."""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: transformers' gradient-checkpointing layers, outermost ones only."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    layers, inside = [], set()
    for name, module in model.named_modules():
        if isinstance(module, GradientCheckpointingLayer) and not any(name.startswith(p + ".") for p in inside):
            layers.append(module)
            inside.add(name)
    return layers


class CompiledLayers:
    """One `torch.compile` (dynamic shapes) of each decoder layer's call, made at first use and kept."""

    def __init__(self):
        self._calls: weakref.WeakKeyDictionary[torch.nn.Module, object] = weakref.WeakKeyDictionary()

    def _call(self, layer: torch.nn.Module):
        if layer not in self._calls:
            self._calls[layer] = torch.compile(layer._call_impl, dynamic=True)
        return self._calls[layer]

    @contextmanager
    def switched(self, model: torch.nn.Module, on: bool):
        """Within the block, the model's decoder layers run compiled (on) or eager (off); restored after."""
        layers = decoder_layers(model)
        saved = [layer._compiled_call_impl for layer in layers]
        for layer in layers:
            layer._compiled_call_impl = self._call(layer) if on else None
        try:
            yield
        finally:
            for layer, call in zip(layers, saved):
                layer._compiled_call_impl = call
