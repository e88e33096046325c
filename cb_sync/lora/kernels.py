"""Triton LoRA for few rows: out_i = base_i + scaling_i * B_i(A_i(x)) for up to three projections that read one
input x (q/k/v, gate/up), with PEFT's dtypes and roundings.

PEFT computes `result + lora_B(lora_A(x.to(A.dtype))) * scaling` and casts back to the result's dtype; with
fp32 adapters on a bf16 model (PEFT's default upcast) cuBLAS runs that as small fp32 SIMT GEMMs plus split-K
reductions: ~10 us a projection at decode sizes. Here a group of projections takes two launches: `shrink`
computes x A_i^T for every member over K splits into fp32 partials (no atomics, so runs are bit-reproducible),
`expand` sums each member's partials in a fixed order, applies B_i, the scaling and the add, its column tiles
spanning all members' outputs. Intermediates are rounded to the compute dtype (the adapter's, or autocast's)
where PEFT's modules round them, and sums run in fp32 as cuBLAS's do; fp32 products run on bf16 tensor cores
with each operand split into three bf16 parts (`_dot`). Grids depend only on shapes (CUDA-graph safe).
"""

import os

import torch
import triton
import triton.language as tl

MAX_MEMBERS = 3       # projections per launch
BLOCK_M = 16          # rows per program
SHRINK_SPLIT_K = 128  # input features per shrink program, loaded SHRINK_BLOCK_K at a time
SHRINK_BLOCK_K = 128  # (benchmarks/NOTES.md, attempt 8)
EXPAND_BLOCK_N = 64
_NATIVE_DOTS = os.environ.get("TRITON_INTERPRET") != "1"
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _bf16_parts(v):
    """fp32 v as the exact sum hi + mid + lo of three bf16 tensors (8 significant bits each)."""
    hi = v.to(tl.bfloat16)
    rest = v - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    return hi, mid, (rest - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _mma(a, b, acc, NATIVE: tl.constexpr):
    """acc + a @ b of 16-bit tiles, fp32 sums. NATIVE False (the CPU interpreter, whose bf16 dot is wrong):
    the same exact products, upcast first."""
    if NATIVE:
        acc = tl.dot(a, b, acc)
    else:
        acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return acc


@triton.jit
def _dot(a, b, acc, A_IS_BF16: tl.constexpr, NATIVE: tl.constexpr):
    """acc + a @ b with fp32 sums on tensor cores. 16-bit operands: one dot (exact products). fp32 operands: each
    split into three bf16 parts and the six partial products above 2^-16 of the leading one summed, smallest
    first: fp32 accuracy, which the fp32 FMA dot gives at ~4x the time. A_IS_BF16: a's values are bf16."""
    if a.dtype != tl.float32:
        acc = _mma(a, b, acc, NATIVE)
    else:
        b_hi, b_mid, b_lo = _bf16_parts(b)
        if A_IS_BF16:
            a_hi = a.to(tl.bfloat16)
            acc = _mma(a_hi, b_lo, acc, NATIVE)
        else:
            a_hi, a_mid, a_lo = _bf16_parts(a)
            acc = _mma(a_lo, b_hi, acc, NATIVE)
            acc = _mma(a_mid, b_mid, acc, NATIVE)
            acc = _mma(a_hi, b_lo, acc, NATIVE)
            acc = _mma(a_mid, b_hi, acc, NATIVE)
        acc = _mma(a_hi, b_mid, acc, NATIVE)
        acc = _mma(a_hi, b_hi, acc, NATIVE)
    return acc


@triton.jit
def _shrink_kernel(x_ptr, a0_ptr, a1_ptr, a2_ptr, r0, r1, r2, partial_ptr, M, K, stride_xm, stride_xk,
                   COMPUTE: tl.constexpr, X_IS_BF16: tl.constexpr, NATIVE: tl.constexpr, SPLIT_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program (row tile, K split, member): partial[member, split, rows, :] = x[rows, split] @ A[:, split]^T."""
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    member = tl.program_id(2)
    if member == 0:
        a_ptr, R = a0_ptr, r0
    elif member == 1:
        a_ptr, R = a1_ptr, r1
    else:
        a_ptr, R = a2_ptr, r2
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(split * SPLIT_K, tl.minimum(split * SPLIT_K + SPLIT_K, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        a = tl.load(a_ptr + ranks[None, :] * K + ks[:, None], mask=(ranks[None, :] < R) & (ks[:, None] < K),
                    other=0.0)
        # x and A in the compute dtype (PEFT casts x to the adapter dtype; autocast casts both)
        acc = _dot(x.to(COMPUTE), a.to(COMPUTE), acc, X_IS_BF16, NATIVE)
    offs = ((member * tl.num_programs(1) + split) * M + rows[:, None]) * BLOCK_R + ranks[None, :]
    tl.store(partial_ptr + offs, acc, mask=rows[:, None] < M)


@triton.jit
def _expand_kernel(partial_ptr, b0_ptr, b1_ptr, b2_ptr, base0_ptr, base1_ptr, base2_ptr, out0_ptr, out1_ptr,
                   out2_ptr, n0, n1, n2, r0, r1, r2, s0, s1, s2, M, num_splits,
                   COMPUTE: tl.constexpr, NATIVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    """Program (column tile over all members, row tile): out = base + round(round(xa @ B^T) * scaling)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    tiles0 = tl.cdiv(n0, BLOCK_N)
    tiles1 = tl.cdiv(n1, BLOCK_N)
    if pid_n < tiles0:
        member, tile, b_ptr, base_ptr, out_ptr, N, R, scaling = 0, pid_n, b0_ptr, base0_ptr, out0_ptr, n0, r0, s0
    elif pid_n < tiles0 + tiles1:
        member, tile, b_ptr, base_ptr, out_ptr, N, R, scaling = (1, pid_n - tiles0, b1_ptr, base1_ptr, out1_ptr,
                                                                  n1, r1, s1)
    else:
        member, tile, b_ptr, base_ptr, out_ptr, N, R, scaling = (2, pid_n - tiles0 - tiles1, b2_ptr, base2_ptr,
                                                                  out2_ptr, n2, r2, s2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    row_ok = rows < M
    xa = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for split in range(num_splits):
        xa += tl.load(partial_ptr + ((member * num_splits + split) * M + rows[:, None]) * BLOCK_R + ranks[None, :],
                      mask=row_ok[:, None], other=0.0)
    b = tl.load(b_ptr + cols[None, :] * R + ranks[:, None], mask=(cols[None, :] < N) & (ranks[:, None] < R),
                other=0.0)
    delta = _dot(xa.to(COMPUTE), b.to(COMPUTE), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), False, NATIVE)
    delta = delta.to(COMPUTE).to(tl.float32)                       # lora_B's output
    delta = (delta * scaling).to(COMPUTE).to(tl.float32)           # * scaling
    mask = row_ok[:, None] & (cols[None, :] < N)
    offs = rows[:, None] * N + cols[None, :]
    base = tl.load(base_ptr + offs, mask=mask, other=0.0)
    out = base.to(tl.float32) + delta
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _padded(values: list, fill) -> list:
    return values + [fill] * (MAX_MEMBERS - len(values))


def lora_add_group(x: torch.Tensor, bases: list[torch.Tensor], lora_as: list[torch.Tensor],
                   lora_bs: list[torch.Tensor], scalings: list[float], compute_dtype: torch.dtype | None = None,
                   split_k: int = SHRINK_SPLIT_K, block_k: int = SHRINK_BLOCK_K) -> list[torch.Tensor]:
    """For each member i: bases[i] [M, N_i] + scalings[i] * (x [M, K] @ lora_as[i] [R_i, K]^T) @ lora_bs[i]
    [N_i, R_i]^T as a new tensor of bases[i]'s dtype, with PEFT's roundings: x, A and B in compute_dtype (default:
    the adapters' dtype, one for all members), each product and the scaled delta rounded to it, sums in fp32.
    Two launches for up to MAX_MEMBERS members. split_k input features per shrink program, loaded block_k at a
    time (tile sizes only, swept by `benchmarks.lora_kernel`)."""
    if not 1 <= len(bases) == len(lora_as) == len(lora_bs) == len(scalings) <= MAX_MEMBERS:
        raise ValueError(f"a group has 1 to {MAX_MEMBERS} members with one base, A, B and scaling each, got "
                         f"{len(bases)}, {len(lora_as)}, {len(lora_bs)}, {len(scalings)}")
    if block_k < 16 or block_k & (block_k - 1) or split_k % block_k:
        raise ValueError(f"block_k must be a power of two >= 16 that divides split_k, got split_k={split_k}, "
                         f"block_k={block_k}")
    compute = _TL_DTYPES[compute_dtype or lora_as[0].dtype]
    m, k = x.shape
    bases = [base.contiguous() for base in bases]
    lora_as, lora_bs = [a.contiguous() for a in lora_as], [b.contiguous() for b in lora_bs]
    outs = [torch.empty(base.shape, dtype=base.dtype, device=base.device) for base in bases]
    if m == 0:
        return outs
    ranks = [a.shape[0] for a in lora_as]
    block_r = max(16, triton.next_power_of_2(max(ranks)))
    num_splits = triton.cdiv(k, split_k)
    partial = torch.empty((len(bases), num_splits, m, block_r), dtype=torch.float32, device=x.device)
    row_tiles = triton.cdiv(m, BLOCK_M)
    _shrink_kernel[(row_tiles, num_splits, len(bases))](
        x, *_padded(lora_as, lora_as[0]), *_padded(ranks, 0), partial, m, k, *x.stride(),
        COMPUTE=compute, X_IS_BF16=x.dtype == torch.bfloat16, NATIVE=_NATIVE_DOTS, SPLIT_K=split_k,
        BLOCK_M=BLOCK_M, BLOCK_K=block_k, BLOCK_R=block_r, num_warps=4)
    widths = [b.shape[0] for b in lora_bs]
    column_tiles = sum(triton.cdiv(n, EXPAND_BLOCK_N) for n in widths)
    _expand_kernel[(column_tiles, row_tiles)](
        partial, *_padded(lora_bs, lora_bs[0]), *_padded(bases, bases[0]), *_padded(outs, outs[0]),
        *_padded(widths, 0), *_padded(ranks, 0), *_padded([float(s) for s in scalings], 0.0), m, num_splits,
        COMPUTE=compute, NATIVE=_NATIVE_DOTS, BLOCK_M=BLOCK_M, BLOCK_N=EXPAND_BLOCK_N, BLOCK_R=block_r, num_warps=4)
    return outs


def lora_add(x: torch.Tensor, base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scaling: float, compute_dtype: torch.dtype | None = None, split_k: int = SHRINK_SPLIT_K,
             block_k: int = SHRINK_BLOCK_K) -> torch.Tensor:
    """One projection: base + scaling * (x @ lora_a^T) @ lora_b^T; see `lora_add_group`."""
    return lora_add_group(x, [base], [lora_a], [lora_b], [scaling], compute_dtype, split_k, block_k)[0]
