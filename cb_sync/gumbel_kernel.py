"""The sampler's draw as one Triton launch on CUDA: per row, the index of max(scores + Gumbel noise), the noise hashed
from (seed, position, token id) exactly as `sampling.uniform_noise` hashes it. The same draw in torch takes ~100
elementwise launches of 32-bit hash steps on int64 tensors (tiny at decode sizes, so the step pays their launch gaps)
and, over the whole vocabulary, as many passes over [rows, vocab] int64 temporaries."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

MAX_BLOCK = 1024      # columns a program reads at a time
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
def _gumbel_argmax_kernel(scores_ptr, ids_ptr, seeds_ptr, positions_ptr, out_ptr, n, stride_scores, stride_ids,
                          HAS_IDS: tl.constexpr, NATIVE: tl.constexpr, BLOCK: tl.constexpr):
    """One row: argmax over its n columns of score - log(-log(u)) as torch.argmax takes it: the first of tied
    columns, and the first NaN where there is one."""
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    low, high = (seed & 0xFFFFFFFF).to(tl.uint32), ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _mix32(low ^ _mix32(high ^ _mix32((position & 0xFFFFFFFF).to(tl.uint32))))
    best = tl.full([], float("-inf"), tl.float32)
    best_index = tl.full([], 0, tl.int64)
    found_nan = tl.full([], 0, tl.int1)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n
        scores = tl.load(scores_ptr + row * stride_scores + cols, mask=inside, other=float("-inf")).to(tl.float32)
        if HAS_IDS:
            ids = tl.load(ids_ptr + row * stride_ids + cols, mask=inside, other=0)
        else:
            ids = cols
        bits = _mix32(key ^ _mix32(ids.to(tl.uint32) ^ tl.full([], TOKEN_SALT, tl.uint32)))
        u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / (1 << 23))
        noisy = tl.where(inside, scores - _log(-_log(u, NATIVE), NATIVE), float("-inf"))
        is_nan = noisy != noisy
        nan_index = tl.min(tl.where(is_nan, cols, n), axis=0)
        noisy = tl.where(is_nan, float("-inf"), noisy)
        top = tl.max(noisy, axis=0)
        index = tl.argmax(noisy, axis=0, tie_break_left=True)
        better = (top > best) & ~found_nan
        best_index = tl.where(better, start + index.to(tl.int64), best_index)
        best = tl.where(better, top, best)
        first_nan = (nan_index < n) & ~found_nan
        best_index = tl.where(first_nan, nan_index.to(tl.int64), best_index)
        found_nan = found_nan | first_nan
    tl.store(out_ptr + row, best_index)


def gumbel_argmax(scores: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  token_ids: torch.Tensor | None) -> torch.Tensor:
    """int64 [S]: per row of scores [S, N] (float), the column of max(score + Gumbel noise) with the noise of
    (seeds[row], positions[row], token_ids[row, column]) (token_ids None: the column is the token id)."""
    rows, n = scores.shape
    out = torch.empty(rows, dtype=torch.int64, device=scores.device)
    if rows == 0:
        return out
    scores = scores if scores.stride(1) == 1 else scores.contiguous()
    ids = scores if token_ids is None else (token_ids if token_ids.stride(1) == 1 else token_ids.contiguous())
    _gumbel_argmax_kernel[(rows,)](scores, ids, seeds.contiguous(), positions.contiguous(), out, n, scores.stride(0),
                                   ids.stride(0), HAS_IDS=token_ids is not None, NATIVE=_NATIVE,
                                   BLOCK=min(MAX_BLOCK, triton.next_power_of_2(n)), num_warps=4)
    return out
