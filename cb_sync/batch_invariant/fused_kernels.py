"""Row-invariant fused kernels for the exact mode's elementwise and norm work: an RMS norm, rotary embeddings of
the queries and keys, and SiLU(gate) x up, each one Triton launch where eager torch takes three to ten.

A program computes one row (a token's hidden state, or one head of it) alone, its reductions in an order fixed by the
row's width, so a row's bits do not depend on how many rows share the launch. Each kernel computes the transformers
formula it replaces in fp32 and rounds once at the end (eager torch rounds after every op: the two differ by a
rounding), and the generator and the trainer both call it, so both get the same numbers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, heads, stride_t, stride_h, width, eps, offset, BLOCK: tl.constexpr):
    """Program r: row r = (token r // heads, head r % heads) of x, out[r] = x_r * rsqrt(mean(x_r^2) + eps) *
    (offset + w) in fp32, rounded once to out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < width
    x = tl.load(x_ptr + (row // heads) * stride_t + (row % heads) * stride_h + cols, mask=valid, other=0.0)
    x = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / width + eps)
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, ((x * inv) * (offset + w)).to(out_ptr.dtype.element_ty), mask=valid)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
             out_dtype: torch.dtype) -> torch.Tensor:
    """The RMS norm of x's last dimension, x * rsqrt(mean(x^2) + eps) * (offset + weight), in fp32 (x of any strides
    with unit stride there; out contiguous, of out_dtype)."""
    width = x.shape[-1]
    rows = x.reshape(-1, 1, width) if x.ndim == 2 else x.reshape(-1, x.shape[-2], width)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if out.numel():
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(rows.shape[0] * rows.shape[1],)](
            rows, weight, out, rows.shape[1], rows.stride(0), rows.stride(1), width, eps, offset, BLOCK=block,
            num_warps=max(1, min(8, block // 256)))
    return out


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, seq_len, q_heads, sqb, sqh, sql, skb, skh,
                   skl, sob, soh, sol, skob, skoh, skol, scb, scl, half, BLOCK: tl.constexpr):
    """Program (token, head): one head row of q (head < q_heads) or of k, out = x * cos + rotate_half(x) * sin in
    fp32, rounded once to the output's dtype."""
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b, pos = token // seq_len, token % seq_len
    if head < q_heads:
        src = q_ptr + b * sqb + head * sqh + pos * sql
        dst = q_out_ptr + b * sob + head * soh + pos * sol
    else:
        src = k_ptr + b * skb + (head - q_heads) * skh + pos * skl
        dst = k_out_ptr + b * skob + (head - q_heads) * skoh + pos * skol
    dtype = q_out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    valid = cols < half
    x1 = tl.load(src + cols, mask=valid, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + cols, mask=valid, other=0.0).to(tl.float32)
    table = b * scb + pos * scl
    c1 = tl.load(cos_ptr + table + cols, mask=valid, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + table + half + cols, mask=valid, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + table + cols, mask=valid, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + table + half + cols, mask=valid, other=0.0).to(tl.float32)
    out1 = x1 * c1 - x2 * s1
    out2 = x2 * c2 + x1 * s2
    tl.store(dst + cols, out1.to(dtype), mask=valid)
    tl.store(dst + half + cols, out2.to(dtype), mask=valid)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb(q, k, cos, sin)` (unsqueeze_dim=1) in one launch: q [B, H, L, D] and
    k [B, Hk, L, D] of any strides with unit stride on D, cos / sin [B or 1, L, D] with unit stride on D; the outputs
    in q's and k's layouts where those are dense (the attention's [B, L, H, D] behind the transpose: no copy later)."""
    batch, q_heads, seq_len, dim = q.shape
    dtype = torch.result_type(q, cos)
    q_out = torch.empty_like(q, dtype=dtype)        # q's layout where it is dense, as eager torch gives
    k_out = torch.empty_like(k, dtype=dtype)
    if q_out.numel():
        table_b = cos.stride(0) if cos.shape[0] > 1 else 0
        assert cos.stride() == sin.stride()
        _rotary_kernel[(batch * seq_len, q_heads + k.shape[1])](
            q, k, cos, sin, q_out, k_out, seq_len, q_heads, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
            k.stride(1), k.stride(2), q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0),
            k_out.stride(1), k_out.stride(2), table_b, cos.stride(1), dim // 2,
            BLOCK=triton.next_power_of_2(dim // 2), num_warps=1)
    return q_out, k_out


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, width, stride_g, stride_u, BLOCK: tl.constexpr):
    """Program (row, column block): silu(gate) * up in fp32, rounded once to the output's dtype."""
    row, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    valid = cols < width
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * stride_g + cols, mask=valid, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (g / (1.0 + tl.exp(-g)) * u).to(dtype), mask=valid)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded once to the result's dtype (gate and up of one shape, unit stride on the last
    dimension; out contiguous)."""
    width = gate.shape[-1]
    g, u = gate.reshape(-1, width), up.reshape(-1, width)
    out = torch.empty(gate.shape, dtype=torch.result_type(gate, up), device=gate.device)
    if out.numel():
        block = 1024
        _silu_mul_kernel[(g.shape[0], triton.cdiv(width, block))](g, u, out, width, g.stride(0), u.stride(0),
                                                                  BLOCK=block, num_warps=4)
    return out
