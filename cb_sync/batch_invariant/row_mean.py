"""Last-dimension means for batch-invariant mode on CUDA, as one Triton launch: a program per row sums its elements in
fp32, BLOCK at a time in one fixed order, so a row's mean does not depend on how many rows share the call, with no
padding and no launch per row block (a trainer's q/k norms see tens of thousands of rows). Differentiable."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 1024


@triton.jit
def _row_mean_kernel(x_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + row * width + cols, mask=cols < width, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, (tl.sum(acc, axis=0) / width).to(out_ptr.dtype.element_ty))


def row_mean(rows: torch.Tensor) -> torch.Tensor:
    """[M] means of rows [M, D] in rows' dtype (fp32 sums), each row's bits independent of M."""
    return _RowMean.apply(rows)


class _RowMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows):
        rows = rows.contiguous()
        num_rows, width = rows.shape
        ctx.shape = rows.shape
        out = torch.empty(num_rows, dtype=rows.dtype, device=rows.device)
        if num_rows and width:
            _row_mean_kernel[(num_rows,)](rows, out, width, BLOCK=min(MAX_BLOCK, triton.next_power_of_2(width)),
                                          num_warps=4)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (grad[:, None] / ctx.shape[1]).expand(ctx.shape)
