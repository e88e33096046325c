"""The row-invariant attention of `attention.row_attention` as one Triton launch: a program per (query row, KV head)
runs the online softmax of the Triton backend (`triton_kernels._attend_range`) over the row's own context, in tiles of
KEYS_PER_BLOCK keys from position 0 on (from the window's first tile with a sliding window: the tiles before it are
exact no-ops), with no split-K. A program reads its row alone, so its bits do not depend on the grid: the generator's
decode and prefill steps and a trainer's full sequences launch the same kernel and get the same numbers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention.triton_kernels import _attend_range


@triton.jit(do_not_specialize=["stride_qt", "stride_tt", "stride_ot"])
def _row_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, row_tables_ptr, positions_ptr, out_ptr, stride_qt,
                stride_qh, stride_tt,
                stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_cd, scale, softcap, window, group,
                block_size, head_dim, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    """Program (row, kv head): the group's query heads of one row over keys 0..position (a position < 0: zeros)."""
    row, kv_head = tl.program_id(0), tl.program_id(1)
    position = tl.load(positions_ptr + row)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * group + g
    row_valid = (g < group) & (position >= 0)
    mask = (g[:, None] < group) & (d[None, :] < head_dim)
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=mask, other=0.0)
    lo = 0
    if HAS_WINDOW:
        lo = (tl.maximum(position - window + 1, 0) // BLOCK_N) * BLOCK_N
    hi = tl.maximum(position + 1, 0)
    table = tl.load(row_tables_ptr + row).to(tl.int64)
    acc, m_i, l_i = _attend_range(q, k_cache_ptr, v_cache_ptr, tables_ptr + table * stride_tt, kv_head, lo, hi, hi,
                                  tl.zeros([BLOCK_G], dtype=tl.int32) + position, row_valid, scale, softcap, window,
                                  block_size, head_dim, stride_cb, stride_cs, stride_ch, stride_cd, BLOCK_G, BLOCK_N,
                                  BLOCK_D, HAS_SOFTCAP, HAS_WINDOW, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)


def row_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  row_tables: torch.Tensor, row_positions: torch.Tensor, scale: float, keys_per_block: int,
                  sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """`attention.row_attention`'s contract; keys_per_block: keys per tile (a power of two >= 16).
    No host synchronisation: decode steps are captured."""
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0 and k_cache.stride() == v_cache.stride()
    query = query.contiguous()                 # one layout on every side: a head's features at unit stride
    out = torch.empty_like(query)
    if num_rows == 0:
        return out
    tables = block_tables.to(torch.int32).contiguous()
    row_tables = row_tables.to(torch.int32).contiguous()
    positions = row_positions.to(torch.int32).contiguous()
    group = num_heads // num_kv_heads
    _row_kernel[(num_rows, num_kv_heads)](
        query, k_cache, v_cache, tables, row_tables, positions, out, query.stride(0), query.stride(1), tables.stride(0),
        out.stride(0), out.stride(1), *k_cache.stride(), scale, float(softcap or 0.0), int(sliding_window or 0), group,
        k_cache.shape[1], head_dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=keys_per_block,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), HAS_SOFTCAP=bool(softcap), HAS_WINDOW=bool(sliding_window),
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", num_warps=4)
    return out
