"""Triton LoRA: out_i = base_i + scaling_i * B_i(A_i(x)) for up to three projections that read one input x (q/k/v,
gate/up), with PEFT's dtypes and roundings.

PEFT computes `result + lora_B(lora_A(x.to(A.dtype))) * scaling` and casts back to the result's dtype; with fp32
adapters on a bf16 model (PEFT's default upcast) cuBLAS runs that as small fp32 SIMT GEMMs plus split-K reductions,
several launches a projection. Here a group of projections takes two launches: `shrink` computes x A_i^T for every
member over K splits into fp32 partials (no atomics, so runs are bit-reproducible), `expand` sums each member's partials
in a fixed order, applies B_i, the scaling and the add, its column tiles spanning all members' outputs. Intermediates
are rounded to the compute dtype (the adapter's, or autocast's) where PEFT's modules round them, and sums run in fp32 as
cuBLAS's do; fp32 products run on bf16 tensor cores with each operand split into three bf16 parts (`_dot`). Grids depend
only on shapes (CUDA-graph safe). On Hopper the expand launch is a programmatic dependent launch: its programs start
while the shrink runs, read or compute their base, and wait for the shrink's partials only before reading them.

`lora_linear_group` also computes the base GEMMs x W_i^T (+ bias) for few rows: in the expand launch for wide groups
(GEMM_BASE), or split over K by extra programs of the shrink launch whose fp32 partials the expand launch sums in a
fixed order (SUMMED_BASE), so narrow layers still fill the GPU.

The fixed tiling (`LoraTuning.fixed_tiling`, batch-invariant mode) gives every row count the same tiles, K splits and
base path (GEMM_BASE or SUMMED_BASE by the group's width, as above, never torch's), and cuts only the rows (into
chunks of at most FIXED_CHUNK_ROWS): each output row is then computed by the same sums in the same order whatever
else shares the call, so its bits depend on that row alone. From `fixed_large_rows` rows on (bf16), the expand
launch takes larger tiles and, where that makes enough programs, computes the split-K base's splits itself
(SPLIT_BASE), summed in the same order: the same sums per output element, on tensor-core instructions of another
shape, which give the same bits only where the GPU rounds them alike (`batch_invariant.lora.large_tiles_agree`
checks that before the mode uses them)."""

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..tuning import LoraTuning

MAX_MEMBERS = 3       # projections per launch
READ_BASE, GEMM_BASE, SUMMED_BASE, SPLIT_BASE = 0, 1, 2, 3   # where the expand launch takes the base from
MAX_OFFSET = torch.iinfo(torch.int32).max   # elements of one operand within reach of the kernels' int32 offsets
SPLIT_BASE_MIN_PROGRAMS = 264   # large tiles' programs (2 a Hopper SM) from which the split-K base runs in them
FIXED_CHUNK_ROWS = 4096   # the fixed tiling's rows a launch pair: its split-K base partials stay ~0.5 GB or less
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
    """acc + a @ b of 16-bit tiles, fp32 sums. NATIVE False, the CPU interpreter (whose bf16 dot is wrong, and whose
    fp32 dot, numpy's BLAS, rounds a row differently by its place in the tile): fp32 products summed over k."""
    if NATIVE:
        acc = tl.dot(a, b, acc)
    else:
        acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return acc


@triton.jit
def _dot(a, b, acc, A_IS_BF16: tl.constexpr, NATIVE: tl.constexpr):
    """acc + a @ b with fp32 sums on tensor cores. 16-bit operands: one dot (exact products). fp32 operands: each
    split into three bf16 parts and the six partial products above 2^-16 of the leading one summed, smallest
    first: fp32 accuracy, in fewer instructions than the fp32 FMA dot. A_IS_BF16: a's values are bf16."""
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
def _x_wt(acc, x_ptr, w_ptr, rows, cols, M, N, K, k_start, k_stop, stride_xm, stride_xk, CAST: tl.constexpr,
          COMPUTE: tl.constexpr, X_IS_BF16: tl.constexpr, NATIVE: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + x[rows, k_start:k_stop] @ W[cols, k_start:k_stop]^T for a row-major W [N, K] (a weight, or an A),
    masked to M rows, N columns and K features; with CAST, both operands in the COMPUTE dtype first."""
    for k0 in range(k_start, k_stop, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[None, :] * K + ks[:, None], mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)
        if CAST:
            x, w = x.to(COMPUTE), w.to(COMPUTE)
        acc = _dot(x, w, acc, X_IS_BF16, NATIVE)
    return acc


@triton.jit
def _shrink_tile(x_ptr, a0_ptr, a1_ptr, a2_ptr, r0, r1, r2, partial_ptr, M, K, stride_xm, stride_xk, pid_m, split,
                 member, num_splits, COMPUTE: tl.constexpr, X_IS_BF16: tl.constexpr, NATIVE: tl.constexpr,
                 SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """partial[member, split, rows, :] = x[rows, split] @ A[:, split]^T."""
    if member == 0:
        a_ptr, R = a0_ptr, r0
    elif member == 1:
        a_ptr, R = a1_ptr, r1
    else:
        a_ptr, R = a2_ptr, r2
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ranks = tl.arange(0, BLOCK_R)
    # x and A in the compute dtype (PEFT casts x to the adapter dtype; autocast casts both)
    acc = _x_wt(tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32), x_ptr, a_ptr, rows, ranks, M, R, K, split * SPLIT_K,
                tl.minimum(split * SPLIT_K + SPLIT_K, K), stride_xm, stride_xk, True, COMPUTE, X_IS_BF16, NATIVE,
                BLOCK_K)
    offs = ((member * num_splits + split) * M + rows[:, None]) * BLOCK_R + ranks[None, :]
    tl.store(partial_ptr + offs, acc, mask=rows[:, None] < M)


@triton.jit
def _base_partial_tile(x_ptr, w0_ptr, w1_ptr, w2_ptr, n0, n1, n2, base_partial_ptr, M, K, stride_xm, stride_xk,
                       tile, split, row_tile, X_IS_BF16: tl.constexpr, NATIVE: tl.constexpr, BLOCK_K: tl.constexpr,
                       BASE_SPLIT_K: tl.constexpr, BASE_BLOCK_M: tl.constexpr, BASE_BLOCK_N: tl.constexpr):
    """base_partial[split, rows, cols] = x[rows, split] @ W[cols, split]^T for column tile `tile` of all members'
    outputs side by side and row tile `row_tile`."""
    tiles0, tiles1 = tl.cdiv(n0, BASE_BLOCK_N), tl.cdiv(n1, BASE_BLOCK_N)
    if tile < tiles0:
        w_ptr, N, first = w0_ptr, n0, 0
    elif tile < tiles0 + tiles1:
        w_ptr, N, first, tile = w1_ptr, n1, n0, tile - tiles0
    else:
        w_ptr, N, first, tile = w2_ptr, n2, n0 + n1, tile - tiles0 - tiles1
    rows = row_tile * BASE_BLOCK_M + tl.arange(0, BASE_BLOCK_M)
    cols = tile * BASE_BLOCK_N + tl.arange(0, BASE_BLOCK_N)
    acc = _x_wt(tl.zeros([BASE_BLOCK_M, BASE_BLOCK_N], dtype=tl.float32), x_ptr, w_ptr, rows, cols, M, N, K,
                split * BASE_SPLIT_K, tl.minimum(split * BASE_SPLIT_K + BASE_SPLIT_K, K), stride_xm, stride_xk,
                False, tl.float32, X_IS_BF16, NATIVE, BLOCK_K)
    offs = (split * M + rows[:, None]) * (n0 + n1 + n2) + first + cols[None, :]
    tl.store(base_partial_ptr + offs, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit(do_not_specialize=["M"])     # one variant for every row count: no JIT build mid-run
def _shrink_kernel(x_ptr, a0_ptr, a1_ptr, a2_ptr, r0, r1, r2, partial_ptr, M, K, stride_xm, stride_xk,
                   row_tiles, num_splits, members, w0_ptr, w1_ptr, w2_ptr, n0, n1, n2, base_partial_ptr,
                   COMPUTE: tl.constexpr, X_IS_BF16: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr,
                   SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                   BASE_SPLIT_K: tl.constexpr, BASE_BLOCK_M: tl.constexpr, BASE_BLOCK_N: tl.constexpr):
    """The first row_tiles x num_splits x members programs: one LoRA shrink tile each. Any further programs: one
    (row tile, column tile, K split) of the split-K base GEMMs each. With PDL the expand launch may start at once."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    lora_programs = row_tiles * num_splits * members
    if pid < lora_programs:
        _shrink_tile(x_ptr, a0_ptr, a1_ptr, a2_ptr, r0, r1, r2, partial_ptr, M, K, stride_xm, stride_xk,
                     pid % row_tiles, (pid // row_tiles) % num_splits, pid // (row_tiles * num_splits), num_splits,
                     COMPUTE, X_IS_BF16, NATIVE, SPLIT_K, BLOCK_M, BLOCK_K, BLOCK_R)
    else:
        # row tiles vary fastest: the programs that read one tile of W run together, so W comes from memory once
        base_splits, base_row_tiles = tl.cdiv(K, BASE_SPLIT_K), tl.cdiv(M, BASE_BLOCK_M)
        index = pid - lora_programs
        weight_tile = index // base_row_tiles
        _base_partial_tile(x_ptr, w0_ptr, w1_ptr, w2_ptr, n0, n1, n2, base_partial_ptr, M, K, stride_xm, stride_xk,
                           weight_tile // base_splits, weight_tile % base_splits, index % base_row_tiles, X_IS_BF16,
                           NATIVE, BLOCK_K, BASE_SPLIT_K, BASE_BLOCK_M, BASE_BLOCK_N)


@triton.jit(do_not_specialize=["M"])
def _expand_kernel(partial_ptr, b0_ptr, b1_ptr, b2_ptr, base0_ptr, base1_ptr, base2_ptr, out0_ptr, out1_ptr,
                   out2_ptr, n0, n1, n2, r0, r1, r2, s0, s1, s2, M, num_splits,
                   x_ptr, w0_ptr, w1_ptr, w2_ptr, bias0_ptr, bias1_ptr, bias2_ptr, K, stride_xm, base_partial_ptr,
                   base_splits, COMPUTE: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr, BASE: tl.constexpr,
                   HAS_BIAS: tl.constexpr, X_IS_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BASE_SPLIT_K: tl.constexpr):
    """Program (row tile, column tile over all members): out = base + round(round(xa @ B^T) * scaling). BASE
    READ_BASE: base read from memory; GEMM_BASE: computed here as x @ W^T; SUMMED_BASE: the shrink launch's split-K
    partials of x @ W^T summed in split order; SPLIT_BASE: the same splits computed here, summed in the same order.
    Computed bases add the bias and round to the output dtype. With PDL the shrink launch's results are read only
    after its completion is awaited (`gdc_wait`)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)     # row tiles fastest: a tile of W is read from memory once
    tiles0, tiles1 = tl.cdiv(n0, BLOCK_N), tl.cdiv(n1, BLOCK_N)
    if pid_n < tiles0:
        member, tile, N, R, scaling, first = 0, pid_n, n0, r0, s0, 0
        b_ptr, base_ptr, out_ptr, w_ptr, bias_ptr = b0_ptr, base0_ptr, out0_ptr, w0_ptr, bias0_ptr
    elif pid_n < tiles0 + tiles1:
        member, tile, N, R, scaling, first = 1, pid_n - tiles0, n1, r1, s1, n0
        b_ptr, base_ptr, out_ptr, w_ptr, bias_ptr = b1_ptr, base1_ptr, out1_ptr, w1_ptr, bias1_ptr
    else:
        member, tile, N, R, scaling, first = 2, pid_n - tiles0 - tiles1, n2, r2, s2, n0 + n1
        b_ptr, base_ptr, out_ptr, w_ptr, bias_ptr = b2_ptr, base2_ptr, out2_ptr, w2_ptr, bias2_ptr
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_R)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols[None, :] < N)
    offs = rows[:, None] * N + cols[None, :]
    if BASE == 0:
        base = tl.load(base_ptr + offs, mask=mask, other=0.0)
        if PDL:
            gdc_wait()
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if BASE == 1:
            acc = _x_wt(acc, x_ptr, w_ptr, rows, cols, M, N, K, 0, K, stride_xm, 1, False, tl.float32, X_IS_BF16,
                        NATIVE, BLOCK_K)
        if BASE == 3:
            for k_start in range(0, K, BASE_SPLIT_K):
                acc += _x_wt(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), x_ptr, w_ptr, rows, cols, M, N, K,
                             k_start, tl.minimum(k_start + BASE_SPLIT_K, K), stride_xm, 1, False, tl.float32,
                             X_IS_BF16, NATIVE, BLOCK_K)
        if PDL:
            gdc_wait()
        if BASE == 2:
            for split in range(base_splits):
                acc += tl.load(base_partial_ptr + (split * M + rows[:, None]) * (n0 + n1 + n2) + first + cols[None, :],
                               mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        base = acc.to(out_ptr.dtype.element_ty)                   # the base layer's output
    xa = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for split in range(num_splits):
        xa += tl.load(partial_ptr + ((member * num_splits + split) * M + rows[:, None]) * BLOCK_R + ranks[None, :],
                      mask=row_ok[:, None], other=0.0)
    b = tl.load(b_ptr + cols[None, :] * R + ranks[:, None], mask=(cols[None, :] < N) & (ranks[:, None] < R), other=0.0)
    delta = _dot(xa.to(COMPUTE), b.to(COMPUTE), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), False, NATIVE)
    delta = delta.to(COMPUTE).to(tl.float32)                       # lora_B's output
    delta = (delta * scaling).to(COMPUTE).to(tl.float32)           # * scaling
    out = base.to(tl.float32) + delta
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """t itself where it is contiguous (`Tensor.contiguous` would cost a dispatch per call)."""
    return t if t.is_contiguous() else t.contiguous()


def _padded(values: list, fill) -> list:
    return values + [fill] * (MAX_MEMBERS - len(values))


def _check_group(x: torch.Tensor, members: list[list], split_k: int | None, block_k: int, readers_of_x: list,
                 out_widths: list[int], chunked: bool = False) -> None:
    """members: per-member lists (bases or weights, As, Bs, scalings); readers_of_x: the matrices applied to x;
    chunked: rows go to the kernels in chunks within their int32 offsets (`_row_chunks`)."""
    if not 1 <= len(members[0]) <= MAX_MEMBERS or any(len(m) != len(members[0]) for m in members):
        raise ValueError(f"a group has 1 to {MAX_MEMBERS} members with one base, A, B and scaling each, got "
                         f"{', '.join(str(len(m)) for m in members)}")
    if block_k < 16 or block_k & (block_k - 1) or (split_k is not None and split_k % block_k):
        raise ValueError(f"block_k must be a power of two >= 16 that divides split_k, got split_k={split_k}, "
                         f"block_k={block_k}")
    widths = [m.shape[1] for m in readers_of_x]
    if any(width != x.shape[1] for width in widths):
        raise ValueError(f"every A (and weight) must read x's {x.shape[1]} input features, got {widths}")
    columns = max([x.shape[1], *out_widths])
    if x.shape[0] * columns > MAX_OFFSET and not chunked:
        raise ValueError(f"{x.shape[0]} rows x {columns} features exceed the kernels' int32 offsets")


@functools.cache
def _pdl(device: torch.device) -> bool:
    """Programmatic dependent launch of the expand launch: Hopper and later."""
    return _NATIVE_DOTS and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _row_chunks(x: torch.Tensor, widths: list[int], tuning: LoraTuning) -> list[slice]:
    """x's rows in chunks within the kernels' int32 offsets: one chunk, except in the fixed tiling, where a row's
    bits do not depend on its chunk."""
    m = x.shape[0]
    if not tuning.fixed_tiling:
        return [slice(0, m)]
    step = max(1, min(FIXED_CHUNK_ROWS, MAX_OFFSET // max([x.shape[1], *widths])))
    return [slice(start, min(start + step, m)) for start in range(0, m, step)] or [slice(0, 0)]


def _shrink_tiles(m: int, k: int, block_k: int, tuning: LoraTuning) -> tuple[int, int]:
    """(rows per program, input features per K split) of the LoRA shrink for m rows."""
    if m >= tuning.large_rows:
        return tuning.large_block_m, triton.cdiv(k, block_k) * block_k
    return tuning.block_m, tuning.shrink_split_k if m < tuning.mid_rows else tuning.mid_split_k


def _fused_tiles(rows: int) -> tuple[int, int, int]:
    """(rows, columns, input features) of an expand program that also computes the base GEMM."""
    return min(64, max(16, triton.next_power_of_2(rows))), 32 if rows <= 16 else 64, 128 if rows <= 32 else 64


def _lora_group(x, outs, bases, weights, biases, lora_as, lora_bs, scalings, compute_dtype, split_k, block_k,
                base_mode, tuning):
    """Shrink, then expand into outs, the base taken from bases (READ_BASE) or computed from weights and biases."""
    m, k = x.shape
    if m == 0:
        return outs
    compute = _TL_DTYPES[compute_dtype or lora_as[0].dtype]
    lora_as, lora_bs = [_contiguous(a) for a in lora_as], [_contiguous(b) for b in lora_bs]
    if base_mode != READ_BASE and x.stride(1) != 1:
        x = x.contiguous()
    ranks, widths = [a.shape[0] for a in lora_as], [out.shape[1] for out in outs]
    block_r = max(16, triton.next_power_of_2(max(ranks)))
    fixed = bool(tuning.fixed_tiling)
    large = (fixed and 0 < tuning.fixed_large_rows <= m and x.dtype == torch.bfloat16
             and all(w.dtype == torch.bfloat16 for w in weights or []))     # the dtypes the GPU's check ran
    if large and base_mode == SUMMED_BASE and SPLIT_BASE_MIN_PROGRAMS <= triton.cdiv(
            m, tuning.fixed_large_block_m) * sum(triton.cdiv(n, tuning.fixed_large_block_n) for n in widths):
        base_mode = SPLIT_BASE                 # enough programs without splitting K: no partials to write, read back
    block_m, default_split = ((tuning.fixed_block_m, tuning.shrink_split_k) if fixed
                              else _shrink_tiles(m, k, block_k, tuning))
    split_k = default_split if split_k is None else split_k
    base_split_k, base_block_n = tuning.summed_base_split_k, tuning.summed_base_block_n
    if split_k % block_k or (base_mode in (SUMMED_BASE, SPLIT_BASE) and base_split_k % block_k):
        raise ValueError(f"block_k={block_k} must divide the shrink split ({split_k} features for {m} rows) and "
                         f"the split-K base's ({base_split_k})")
    num_splits = triton.cdiv(k, split_k)
    partial = torch.empty((len(outs), num_splits, m, block_r), dtype=torch.float32, device=x.device)
    row_tiles = triton.cdiv(m, block_m)
    base_splits = triton.cdiv(k, base_split_k) if base_mode == SUMMED_BASE else 0
    base_partial = (torch.empty((base_splits, m, sum(widths)), dtype=torch.float32, device=x.device) if base_splits
                    else partial)                                    # unread without base splits
    base_block_m = tuning.fixed_block_m if fixed else max(16, triton.next_power_of_2(m))
    base_programs = base_splits * sum(triton.cdiv(n, base_block_n) for n in widths) * triton.cdiv(m, base_block_m)
    weights = weights or outs                                        # unread when absent
    pdl = _pdl(x.device)
    _shrink_kernel[(row_tiles * num_splits * len(outs) + base_programs,)](
        x, *_padded(lora_as, lora_as[0]), *_padded(ranks, 0), partial, m, k, *x.stride(), row_tiles, num_splits,
        len(outs), *_padded(weights, weights[0]), *_padded(widths, 0), base_partial,
        COMPUTE=compute, X_IS_BF16=x.dtype == torch.bfloat16, NATIVE=_NATIVE_DOTS, PDL=pdl, SPLIT_K=split_k,
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r, BASE_SPLIT_K=base_split_k, BASE_BLOCK_N=base_block_n,
        BASE_BLOCK_M=base_block_m if base_splits else 16, num_warps=tuning.shrink_warps,
        num_stages=tuning.shrink_stages)
    warps = tuning.expand_warps
    if large:
        block_m, block_n, warps = tuning.fixed_large_block_m, tuning.fixed_large_block_n, tuning.fixed_large_warps
        block_k = tuning.fixed_block_k if base_mode == GEMM_BASE else block_k
    elif base_mode == GEMM_BASE:
        block_m, block_n, block_k = ((tuning.fixed_block_m, tuning.fixed_block_n, tuning.fixed_block_k) if fixed
                                     else _fused_tiles(m))
    else:
        block_n, block_k = tuning.expand_block_n, 16
    column_tiles = sum(triton.cdiv(n, block_n) for n in widths)
    has_bias = biases is not None
    bases, biases = bases or outs, biases or outs                    # unread when absent
    _expand_kernel[(triton.cdiv(m, block_m), column_tiles)](
        partial, *_padded(lora_bs, lora_bs[0]), *_padded(bases, bases[0]), *_padded(outs, outs[0]),
        *_padded(widths, 0), *_padded(ranks, 0), *_padded([float(s) for s in scalings], 0.0), m, num_splits,
        x, *_padded(weights, weights[0]), *_padded(biases, biases[0]), k, x.stride(0), base_partial, base_splits,
        COMPUTE=compute, NATIVE=_NATIVE_DOTS, PDL=pdl, BASE=base_mode, HAS_BIAS=has_bias,
        X_IS_BF16=x.dtype == torch.bfloat16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=block_r,
        BASE_SPLIT_K=base_split_k, num_warps=warps, num_stages=tuning.expand_stages, launch_pdl=pdl)
    return outs


def lora_add_group(x: torch.Tensor, bases: list[torch.Tensor], lora_as: list[torch.Tensor], lora_bs: list[torch.Tensor],
                   scalings: list[float], compute_dtype: torch.dtype | None = None, split_k: int | None = None,
                   block_k: int | None = None, tuning: LoraTuning = LoraTuning()) -> list[torch.Tensor]:
    """For each member i: bases[i] [M, N_i] + scalings[i] * (x [M, K] @ lora_as[i] [R_i, K]^T) @ lora_bs[i]
    [N_i, R_i]^T as a new tensor of bases[i]'s dtype, with PEFT's roundings: x, A and B in compute_dtype (default:
    the adapters' dtype, one for all members), each product and the scaled delta rounded to it, sums in fp32.
    Two launches for up to MAX_MEMBERS members. split_k input features per shrink program (None: chosen by the
    row count), loaded block_k at a time (None: the tuning's; tile sizes only)."""
    block_k = tuning.shrink_block_k if block_k is None else block_k
    widths = [b.shape[-1] for b in bases]
    _check_group(x, [bases, lora_as, lora_bs, scalings], split_k, block_k, lora_as, widths, tuning.fixed_tiling)
    bases = [_contiguous(base) for base in bases]
    outs = [torch.empty(base.shape, dtype=base.dtype, device=base.device) for base in bases]
    for rows in _row_chunks(x, widths, tuning):
        _lora_group(x[rows], [out[rows] for out in outs], [base[rows] for base in bases], None, None, lora_as,
                    lora_bs, scalings, compute_dtype, split_k, block_k, READ_BASE, tuning)
    return outs


def lora_linear_group(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor],
                      lora_as: list[torch.Tensor], lora_bs: list[torch.Tensor], scalings: list[float],
                      compute_dtype: torch.dtype | None = None,
                      tuning: LoraTuning = LoraTuning()) -> list[torch.Tensor]:
    """`lora_add_group` over the bases x [M, K] @ weights[i] [N_i, K]^T (+ biases[i], all members or none) rounded to
    the weights' dtype (x's), as nn.Linear gives them. Up to the tuning's fused_base_max_rows rows and fused_base_max_k
    input features (gemm_base_max_k for groups of gemm_base_min_columns outputs) the kernel computes them, in the
    group's two launches; beyond, or for weights past the kernels' int32 offsets, torch does. In the fixed tiling
    the kernel always does (weights past the offsets: ValueError)."""
    widths = [w.shape[0] for w in weights]
    _check_group(x, [weights, lora_as, lora_bs, scalings], None, tuning.shrink_block_k, lora_as + weights, widths,
                 tuning.fixed_tiling)
    if biases and len(biases) != len(weights):
        raise ValueError(f"biases for all {len(weights)} members or none, got {len(biases)}")
    mode = GEMM_BASE if sum(widths) >= tuning.gemm_base_min_columns else SUMMED_BASE
    oversized = any(w.numel() > MAX_OFFSET for w in weights)
    if tuning.fixed_tiling:
        if oversized:
            raise ValueError(f"weights of {max(w.numel() for w in weights)} elements exceed the kernels' int32 offsets")
    else:
        max_k = tuning.gemm_base_max_k if mode == GEMM_BASE else tuning.fused_base_max_k
        if x.shape[0] > tuning.fused_base_max_rows or x.shape[1] > max_k or oversized:
            bases = [torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases or [None] * len(weights))]
            # the new base tensors (checked by the test above) are this call's own: the kernel adds into them in place
            return _lora_group(x, bases, bases, None, None, lora_as, lora_bs, scalings, compute_dtype, None,
                               tuning.shrink_block_k, READ_BASE, tuning)
    weights, biases = [_contiguous(w) for w in weights], [_contiguous(b) for b in biases] or None
    outs = [torch.empty((x.shape[0], w.shape[0]), dtype=w.dtype, device=w.device) for w in weights]
    for rows in _row_chunks(x, widths, tuning):
        _lora_group(x[rows], [out[rows] for out in outs], None, weights, biases, lora_as, lora_bs, scalings,
                    compute_dtype, None, tuning.shrink_block_k, mode, tuning)
    return outs


def lora_add(x: torch.Tensor, base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scaling: float, compute_dtype: torch.dtype | None = None, split_k: int | None = None,
             block_k: int | None = None, tuning: LoraTuning = LoraTuning()) -> torch.Tensor:
    """One projection: base + scaling * (x @ lora_a^T) @ lora_b^T; see `lora_add_group`."""
    return lora_add_group(x, [base], [lora_a], [lora_b], [scaling], compute_dtype, split_k, block_k, tuning)[0]
