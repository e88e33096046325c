"""The sampler's draw in Triton on CUDA: per row, the index of max(scores + Gumbel noise), the noise hashed from
(seed, position, token id) exactly as `sampling.uniform_noise` hashes it; a wide row is drawn by several programs and
their results combined by a second launch. The same draw in torch takes ~100 elementwise launches of 32-bit hash
steps on int64 tensors (tiny at decode sizes, so the step pays their launch gaps) and, over the whole vocabulary, as
many passes over [rows, vocab] int64 temporaries."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

MAX_BLOCK = 1024      # columns a program reads at a time
SPLIT_COLUMNS = 8192  # columns a program draws over at most: a vocabulary row of 151,936 takes 19 programs
TOKEN_SALT = tl.constexpr(0x9E3779B9)   # `sampling._token_hash`'s
_NATIVE = os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _log(x, NATIVE: tl.constexpr):
    """CUDA's logf (what torch.log computes on the GPU); the interpreter's log on the CPU."""
    if NATIVE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (`sampling._mix32`): products wrap mod 2^32."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(scores_ptr, ids_ptr, seeds_ptr, positions_ptr, out_ptr, best_ptr, index_ptr, nan_ptr, n,
                          span, stride_scores, stride_ids, HAS_IDS: tl.constexpr, NATIVE: tl.constexpr,
                          SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, split): argmax of score - log(-log(u)) over the row's columns [split * span, +span) as
    torch.argmax takes it: the first of tied columns, and the first NaN where there is one. Without SPLIT (one split
    a row) it writes the row's column; with SPLIT its best value, that value's column and its first NaN's column (n
    if none), for `_combine_splits`."""
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    low, high = (seed & 0xFFFFFFFF).to(tl.uint32), ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _mix32(low ^ _mix32(high ^ _mix32((position & 0xFFFFFFFF).to(tl.uint32))))
    lo = split * span
    hi = tl.minimum(lo + span, n)
    best = tl.full([], float("-inf"), tl.float32)
    best_index = lo.to(tl.int64)
    first_nan = tl.zeros([], tl.int64) + n
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < hi
        scores = tl.load(scores_ptr + row * stride_scores + cols, mask=inside, other=float("-inf")).to(tl.float32)
        if HAS_IDS:
            ids = tl.load(ids_ptr + row * stride_ids + cols, mask=inside, other=0)
        else:
            ids = cols
        bits = _mix32(key ^ _mix32(ids.to(tl.uint32) ^ tl.full([], TOKEN_SALT, tl.uint32)))
        u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / (1 << 23))
        noisy = tl.where(inside, scores - _log(-_log(u, NATIVE), NATIVE), float("-inf"))
        is_nan = noisy != noisy
        first_nan = tl.minimum(first_nan, tl.min(tl.where(is_nan, cols, n), axis=0).to(tl.int64))
        noisy = tl.where(is_nan, float("-inf"), noisy)
        top = tl.max(noisy, axis=0)
        index = tl.argmax(noisy, axis=0, tie_break_left=True)
        better = top > best
        best_index = tl.where(better, start + index.to(tl.int64), best_index)
        best = tl.where(better, top, best)
    if SPLIT:
        slot = row * tl.num_programs(1) + split
        tl.store(best_ptr + slot, best)
        tl.store(index_ptr + slot, best_index)
        tl.store(nan_ptr + slot, first_nan)
    else:
        tl.store(out_ptr + row, tl.where(first_nan < n, first_nan, best_index))


@triton.jit
def _combine_splits(best_ptr, index_ptr, nan_ptr, out_ptr, n, splits, BLOCK_S: tl.constexpr):
    """One row: its splits' results in column order, the first NaN if any split saw one, else the column of the
    greatest value, the earliest split's among equals (its own column being its first among equals)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    inside = s < splits
    best = tl.load(best_ptr + row * splits + s, mask=inside, other=float("-inf"))
    index = tl.load(index_ptr + row * splits + s, mask=inside, other=0)
    first_nan = tl.min(tl.load(nan_ptr + row * splits + s, mask=inside, other=n), axis=0)
    winner = tl.argmax(best, axis=0, tie_break_left=True)
    chosen = tl.sum(tl.where(s == winner, index, 0), axis=0)
    tl.store(out_ptr + row, tl.where(first_nan < n, first_nan, chosen))


def gumbel_argmax(scores: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  token_ids: torch.Tensor | None, split_columns: int | None = None) -> torch.Tensor:
    """int64 [S]: per row of scores [S, N] (float), the column of max(score + Gumbel noise) with the noise of
    (seeds[row], positions[row], token_ids[row, column]) (token_ids None: the column is the token id). A row wider
    than split_columns (None: SPLIT_COLUMNS) is split across programs, their results combined by a second launch: a
    program a whole vocabulary row would be a serial loop of ~150 tiles, however few the rows."""
    rows, n = scores.shape
    out = torch.empty(rows, dtype=torch.int64, device=scores.device)
    if rows == 0:
        return out
    scores = scores if scores.stride(1) == 1 else scores.contiguous()
    ids = scores if token_ids is None else (token_ids if token_ids.stride(1) == 1 else token_ids.contiguous())
    block = min(MAX_BLOCK, triton.next_power_of_2(n))
    span = triton.cdiv(max(split_columns or SPLIT_COLUMNS, block), block) * block
    splits = triton.cdiv(n, span)
    partial = [torch.empty((rows, splits), dtype=dtype, device=scores.device)
               for dtype in (torch.float32, torch.int64, torch.int64)] if splits > 1 else [out] * 3
    _gumbel_argmax_kernel[(rows, splits)](scores, ids, seeds.contiguous(), positions.contiguous(), out, *partial, n,
                                          span, scores.stride(0), ids.stride(0), HAS_IDS=token_ids is not None,
                                          NATIVE=_NATIVE, SPLIT=splits > 1, BLOCK=block, num_warps=4)
    if splits > 1:
        _combine_splits[(rows,)](*partial, out, n, splits, BLOCK_S=triton.next_power_of_2(splits), num_warps=1)
    return out
