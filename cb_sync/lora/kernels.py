"""Triton LoRA for few rows: out = base + scaling * B(A(x)), with PEFT's dtypes and roundings.

PEFT computes `result + lora_B(lora_A(x.to(A.dtype))) * scaling` and casts back to the result's dtype; with
fp32 adapters on a bf16 model (PEFT's default upcast) cuBLAS runs that as small fp32 SIMT GEMMs plus split-K
reductions: ~10 us a projection at decode sizes. Here it is two launches: `shrink` computes x A^T over K
splits into fp32 partials (no atomics, so runs are bit-reproducible), `expand` sums the partials in a fixed
order, applies B, the scaling and the add. Intermediates are rounded to the compute dtype (the adapter's, or
autocast's) where PEFT's modules round them, and sums run in fp32 as cuBLAS's do. Grids depend only on
shapes (CUDA-graph safe).
"""

import torch
import triton
import triton.language as tl

BLOCK_M = 16         # rows per program
SHRINK_SPLIT_K = 256  # input features per shrink program, loaded SHRINK_BLOCK_K at a time: the tile whose
SHRINK_BLOCK_K = 64   # decode steps measured fastest (benchmarks/NOTES.md, attempt 6)
EXPAND_BLOCK_N = 64
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, partial_ptr, M, K, R, stride_xm, stride_xk, stride_ar, stride_ak,
                   COMPUTE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    """Program (row tile, K split): partial[split, rows, :] = x[rows, split] @ A[:, split]^T in fp32."""
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(split * SPLIT_K, tl.minimum(split * SPLIT_K + SPLIT_K, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        a = tl.load(a_ptr + ranks[None, :] * stride_ar + ks[:, None] * stride_ak,
                    mask=(ranks[None, :] < R) & (ks[:, None] < K), other=0.0)
        # x and A in the compute dtype (PEFT casts x to the adapter dtype; autocast casts both)
        x = x.to(COMPUTE).to(tl.float32)
        acc += tl.dot(x, a.to(COMPUTE).to(tl.float32), input_precision="ieee")
    offs = (split * M + rows[:, None]) * BLOCK_R + ranks[None, :]
    tl.store(partial_ptr + offs, acc, mask=rows[:, None] < M)


@triton.jit
def _expand_kernel(partial_ptr, b_ptr, base_ptr, out_ptr, M, N, R, num_splits, scaling,
                   stride_bn, stride_br, stride_basem, stride_basen, stride_om, stride_on,
                   COMPUTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program (column tile, row tile): out = base + round(round(xa @ B^T) * scaling) over its tile."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    row_ok = rows < M
    xa = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for split in range(num_splits):
        xa += tl.load(partial_ptr + (split * M + rows[:, None]) * BLOCK_R + ranks[None, :],
                      mask=row_ok[:, None], other=0.0)
    xa = xa.to(COMPUTE).to(tl.float32)                            # lora_A's output
    b = tl.load(b_ptr + cols[None, :] * stride_bn + ranks[:, None] * stride_br,
                mask=(cols[None, :] < N) & (ranks[:, None] < R), other=0.0)
    delta = tl.dot(xa, b.to(COMPUTE).to(tl.float32), input_precision="ieee")
    delta = delta.to(COMPUTE).to(tl.float32)                       # lora_B's output
    delta = (delta * scaling).to(COMPUTE).to(tl.float32)           # * scaling
    mask = row_ok[:, None] & (cols[None, :] < N)
    base = tl.load(base_ptr + rows[:, None] * stride_basem + cols[None, :] * stride_basen, mask=mask, other=0.0)
    out = base.to(tl.float32) + delta
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
             out.to(out_ptr.dtype.element_ty), mask=mask)


def lora_add(x: torch.Tensor, base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scaling: float, compute_dtype: torch.dtype | None = None, split_k: int = SHRINK_SPLIT_K,
             block_k: int = SHRINK_BLOCK_K) -> torch.Tensor:
    """base [M, N] + scaling * (x [M, K] @ lora_a [R, K]^T) @ lora_b [N, R]^T as a new [M, N] tensor of
    base's dtype, with PEFT's roundings: x, A and B in compute_dtype (default: the adapter's), each product
    and the scaled delta rounded to it, sums in fp32. split_k input features per shrink program, loaded
    block_k at a time (tile sizes only, swept by `benchmarks.lora_kernel`)."""
    if block_k < 16 or block_k & (block_k - 1) or split_k % block_k:
        raise ValueError(f"block_k must be a power of two >= 16 that divides split_k, got split_k={split_k}, "
                         f"block_k={block_k}")
    compute = _TL_DTYPES[compute_dtype or lora_a.dtype]
    (m, k), (n, r) = x.shape, lora_b.shape
    out = torch.empty_like(base)
    if m == 0:
        return out
    block_r = max(16, triton.next_power_of_2(r))
    num_splits = triton.cdiv(k, split_k)
    partial = torch.empty((num_splits, m, block_r), dtype=torch.float32, device=x.device)
    row_tiles = triton.cdiv(m, BLOCK_M)
    _shrink_kernel[(row_tiles, num_splits)](
        x, lora_a, partial, m, k, r, *x.stride(), *lora_a.stride(),
        COMPUTE=compute, SPLIT_K=split_k, BLOCK_M=BLOCK_M, BLOCK_K=block_k, BLOCK_R=block_r, num_warps=4)
    _expand_kernel[(triton.cdiv(n, EXPAND_BLOCK_N), row_tiles)](
        partial, lora_b, base, out, m, n, r, num_splits, float(scaling), *lora_b.stride(), *base.stride(),
        *out.stride(), COMPUTE=compute, BLOCK_M=BLOCK_M, BLOCK_N=EXPAND_BLOCK_N, BLOCK_R=block_r, num_warps=4)
    return out
