"""The training step's decoder layers compiled one by one (regional compilation), for CBSyncGRPOTrainer's
`compile_layers=True`. (The rollouts' compiled decode step is the runner's own, `cb_sync.runner.compiled`.)

A training step's forwards and backward are host-bound at small batches: an eager step issues many kernels, most of
them elementwise (RMSNorm in fp32, rotary, residual adds, SiLU, LoRA's scaling and adds). `torch.compile` of each
decoder layer's call fuses them. The layers of one class share one code object, so they share its compiled graphs:
one compile per variety of call (gradients or none, padding or none, adapter on or off), reused by every layer,
instead of the whole model's compile, which takes far longer per variety. Shapes are dynamic from the first call, so
new widths do not recompile. Without dropout the values are those of the fused kernels: equal to eager
ones up to rounding, not bit for bit (with dropout, other random draws).

`CompiledLayers.switched(model, on)` sets each layer's compiled call (on) or none (off) for a block and restores what
was there after, so blocks nest: the trainer switches the layers on for a training step and off again for its
rollout, whose own compiled decode step traces the layers as they were when it was compiled."""

from __future__ import annotations

import functools
import weakref

import torch

from ....model_patching.swaps import attribute_set


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: transformers' gradient-checkpointing layers, outermost ones only."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    if isinstance(model, GradientCheckpointingLayer):
        return [model]
    return [layer for child in model.children() for layer in decoder_layers(child)]


class CompiledLayers:
    """One `torch.compile` (dynamic shapes) of a module's call, given each decoder layer as its module."""

    def __init__(self):
        self._compiled_call = torch.compile(torch.nn.Module._call_impl, dynamic=True)
        self._layers: weakref.WeakKeyDictionary[torch.nn.Module, list] = weakref.WeakKeyDictionary()

    def layers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """`decoder_layers(model)`, found once per model."""
        if model not in self._layers:
            self._layers[model] = decoder_layers(model)
        return self._layers[model]

    def switched(self, model: torch.nn.Module, on: bool):
        """A block within which the model's decoder layers run compiled (on) or eager (off); restored after."""
        return attribute_set(self.layers(model), "_compiled_call_impl",
                             lambda layer: functools.partial(self._compiled_call, layer) if on else None)
