"""Batch-invariant execution (`CBConfig(batch_invariant=True)`): a row's result depends on that row alone, not on how
many rows share the call or where the row sits among them.

torch picks its kernels by shape (cuBLAS's GEMM and split-K choices, the reduction kernels' splits, the CPU's blocking
and threading), so one token computed among 4 rows and among 2,560 goes through different reduction orders and comes
out with different bits. Inside `invariant_ops()`, linear layers, layer / RMS norms and reductions over the last
dimension (mean, softmax, log_softmax, cumsum) run over blocks of exactly ROWS rows, the last one padded with zeros:
every call has one shape whatever the batch. max / argmax / top-k are exact, and elementwise ops compute each element
alone (on the CPU, a tensor's last few elements may take a scalar path that rounds transcendental functions
differently from the vector one: row widths that are multiples of 16, as every model's are, keep rows out of it).
On CUDA a last-dimension mean is one launch of a program per row (`row_mean`). Attention has its own row-invariant
path (`attention`), and PEFT LoRA layers the LoRA kernel in one fixed tiling (`lora.invariant_tuning`);
`check_model` refuses layers this does not cover.

The cost: rows below ROWS are padded (memory-bound decode steps read the weights once either way) and a large batch
takes one call per ROWS rows."""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

ROWS = 64    # rows per call of every invariant op
_SUSPENDED = threading.local()

_LINEAR = {torch.nn.functional.linear}
_NORMS = {torch.nn.functional.layer_norm, torch.nn.functional.rms_norm}
_MEANS = {torch.mean, torch.Tensor.mean}
_REDUCTIONS = {*_MEANS, torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax,
               torch.log_softmax, torch.Tensor.log_softmax, torch.nn.functional.log_softmax, torch.cumsum,
               torch.Tensor.cumsum}   # over the last dimension


def in_row_blocks(rows: torch.Tensor, fn) -> torch.Tensor:
    """fn over rows [M, ...] in blocks of ROWS rows (the last padded with zeros), results concatenated: fn sees one
    shape for every M. fn must compute each row from that row alone."""
    m = rows.shape[0]
    padding = -m % ROWS
    if padding:
        rows = torch.cat([rows, rows.new_zeros(padding, *rows.shape[1:])])
    outs = [fn(block) for block in rows.split(ROWS)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[:m] if padding else out


def _last_dim(dim, ndim: int) -> bool:
    if isinstance(dim, (tuple, list)):
        dim = dim[0] if len(dim) == 1 else None
    return isinstance(dim, int) and dim % ndim == ndim - 1


def _per_row(x: torch.Tensor, fn) -> torch.Tensor:
    """fn over x's rows flattened to [M, last] in row blocks, reshaped back to x's leading dimensions."""
    out = in_row_blocks(x.reshape(-1, x.shape[-1]), fn)
    return out.view(*x.shape[:-1], *out.shape[1:])


def linear_rows(input, weight, bias=None):
    """F.linear in row blocks: what `invariant_ops` makes of a linear layer."""
    return _per_row(input, lambda block: torch.nn.functional.linear(block, weight, bias))


def _norm(func, input, normalized_shape, *args, **kwargs):
    """layer_norm / rms_norm over the last dimension, in row blocks."""
    return _per_row(input, lambda block: func(block, normalized_shape, *args, **kwargs))


def _mean_kernel_serves(x: torch.Tensor) -> bool:
    """CUDA's floating-point means go to one Triton launch (`row_mean`) instead of row blocks."""
    return x.is_cuda and x.is_floating_point()


def _over_last_dim(func, x, args, kwargs):
    """func(x, dim, ...) with dim the last one, over x's rows flattened to [M, last]."""
    if func in _MEANS and _mean_kernel_serves(x) and not kwargs.keys() - {"dim", "keepdim"} and len(args) <= 2:
        from .row_mean import row_mean
        keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
        out = row_mean(x.reshape(-1, x.shape[-1])).view(x.shape[:-1])
        return out.unsqueeze(-1) if keepdim else out
    if args:
        args = (-1, *args[1:])
    else:
        kwargs = {**kwargs, "dim": -1}
    return _per_row(x, lambda block: func(block, *args, **kwargs))


class _InvariantOps(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_suspended():
            return func(*args, **kwargs)
        if func in _LINEAR:
            return linear_rows(*args, **kwargs)
        if (func in _NORMS and len(args) > 1 and args[0].ndim >= 2 and isinstance(args[1], (list, tuple))
                and len(args[1]) == 1):
            return _norm(func, *args, **kwargs)
        if func in _REDUCTIONS and args and isinstance(args[0], torch.Tensor) and args[0].ndim >= 2:
            x, rest = args[0], args[1:]
            dim = rest[0] if rest else kwargs.get("dim")
            if dim is not None and _last_dim(dim, x.ndim):
                return _over_last_dim(func, x, rest, kwargs)
        return func(*args, **kwargs)


def is_suspended() -> bool:
    return getattr(_SUSPENDED, "on", False)


def invariant_ops():
    """Within the block, linear layers and last-dimension reductions run batch-invariantly (see the module); inside
    a `suspended()` block, nothing changes."""
    return contextlib.nullcontext() if is_suspended() else _InvariantOps()


@contextlib.contextmanager
def suspended():
    """Within the block (on this thread), `invariant_ops()` blocks, also those entered before it, leave every op as
    it is: a forward that need not be batch-invariant, run inside one that is."""
    previous = is_suspended()
    _SUSPENDED.on = True
    try:
        yield
    finally:
        _SUSPENDED.on = previous


def check_model(model: torch.nn.Module) -> None:
    """ValueError for layers whose products `invariant_ops` does not run in row blocks: GPT-2-style Conv1D (addmm),
    and weights of three or more dimensions (mixture-of-experts batched matmuls, convolutions)."""
    for name, module in model.named_modules():
        if type(module).__name__ == "Conv1D" or any(p.ndim >= 3 for p in module.parameters(recurse=False)):
            raise ValueError(f"batch_invariant=True covers linear layers, not {type(module).__name__} ({name}): "
                             "its products would depend on the batch")
