"""Module forwards and other attributes swapped for the length of a block, and put back also when it raises; a
model's modules listed in one quick walk; the transformers model under a PEFT wrapper."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch


@contextmanager
def forwards_swapped(modules: Iterable[torch.nn.Module], make_forward: Callable[[torch.nn.Module], Callable]):
    """Within the block each module runs make_forward(module), which may wrap its current `module.forward`;
    afterwards its own forward again (an instance-level forward already there, e.g. accelerate's hook, is kept)."""
    patched = []
    try:
        for module in modules:
            previous = module.__dict__.get("forward")
            module.forward = make_forward(module)
            patched.append((module, previous))
        yield
    finally:
        for module, previous in patched:
            if previous is None:
                del module.forward
            else:
                module.forward = previous


@contextmanager
def attribute_set(objects: Iterable, name: str, make_value: Callable[[object], object]):
    """Within the block each object's attribute `name` is make_value(object); afterwards its value from before, also
    when the block raises, so blocks nest."""
    saved = []
    try:
        for obj in objects:
            saved.append((obj, getattr(obj, name)))
            setattr(obj, name, make_value(obj))
        yield
    finally:
        for obj, value in saved:
            setattr(obj, name, value)


def module_list(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module of `model` once, parents before children: what `model.modules()` yields, in breadth-first order,
    without a generator per module (generate() walks a model several times a call)."""
    modules, seen = [model], {id(model)}
    for module in modules:
        for child in module._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                modules.append(child)
    return modules


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers PreTrainedModel under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
