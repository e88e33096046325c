"""Triton paged attention: KV-cache store, split-K decode in one launch (the step's K/V stored, partitions attended and
combined by the last one to finish) and varlen prefill over a paged KV cache.

Same contract as `sdpa_paged`, without its host-side bounds, for batches where every request brings at least one query
(the decode kernels serve batches of one query per request, told apart by shape). The query heads that share a KV head
are packed into the rows of one program (row = query * BLOCK_G + head in group), so each K/V tile is loaded once per KV
head. Every launch grid depends only on tensor shapes, never on values, so a decode step can be captured in a CUDA graph
and replayed with new seq_lens / block_tables. No function here synchronises with the host."""

import functools

import torch
import triton
import triton.language as tl

from ..tuning import AttentionTuning


@triton.jit
def _store_kv_row(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, tok, head, slot, d,
                  stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                  stride_cb, stride_cs, stride_ch, stride_cd, block_size, head_dim):
    """Copy token tok's key and value rows of one kv head (features d) into cache slot `slot`."""
    mask = d < head_dim
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + head * stride_ch + d * stride_cd
    k = tl.load(key_ptr + tok * stride_kt + head * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + head * stride_vh + d * stride_vd, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                     stride_cb, stride_cs, stride_ch, stride_cd, block_size, head_dim, BLOCK_D: tl.constexpr):
    """One program per (token, kv head): copy its key and value rows into the cache slot."""
    tok, head = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_ptr + tok)
    if slot >= 0:
        _store_kv_row(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, tok, head, slot, tl.arange(0, BLOCK_D),
                      stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                      stride_cb, stride_cs, stride_ch, stride_cd, block_size, head_dim)


@triton.jit
def _attend_tile(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, start, kv_end, q_pos, row_valid,
                 scale, softcap, window, block_size, head_dim, stride_cb, stride_cs, stride_ch, stride_cd,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    """Online-softmax update of (acc, m_i in log2 units, l_i) with keys [start, start + BLOCK_N) of one request;
    keys at or past kv_end are never read (nor their block-table entries)."""
    k_pos = start + tl.arange(0, BLOCK_N)
    kv_valid = k_pos < kv_end
    block = tl.load(table_ptr + k_pos // block_size, mask=kv_valid, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    key_base = block * stride_cb + (k_pos % block_size) * stride_cs + kv_head * stride_ch
    offs = key_base[:, None] + d[None, :] * stride_cd
    kv_mask = kv_valid[:, None] & (d[None, :] < head_dim)
    k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if HAS_SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)   # softcap * tanh(s / softcap)
    allowed = row_valid[:, None] & kv_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
    s = tl.where(allowed, s * 1.4426950408889634, float("-inf"))   # log2(e): softmax via exp2
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, m_new, l_i


@triton.jit
def _attend_range(q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, lo, hi, kv_end, q_pos, row_valid, scale, softcap,
                  window, block_size, head_dim, stride_cb, stride_cs, stride_ch, stride_cd, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Unnormalised online-softmax attention (acc, m in log2 units, l) of q's rows over keys [lo, hi) of one
    request, in tiles of BLOCK_N from lo. A tile is masked at kv_end, not at hi, so hi - lo must be whole tiles or
    hi = kv_end (keys at or past kv_end are never read)."""
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, start, kv_end,
                                     q_pos, row_valid, scale, softcap, window, block_size, head_dim,
                                     stride_cb, stride_cs, stride_ch, stride_cd,
                                     BLOCK_N, BLOCK_D, HAS_SOFTCAP, HAS_WINDOW, PRECISION)
    return acc, m_i, l_i


@triton.jit
def _decode_kernel(q_ptr, key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, pools_ptr, slot_ptr, block_tables_ptr,
                   seq_lens_ptr, query_start_loc_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, arrivals_ptr,
                   stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                   stride_ot, stride_oh, stride_od, stride_cb, stride_cs, stride_ch, stride_cd, stride_bt,
                   num_heads, num_kv_heads, num_partitions, max_context, scale, softcap, window, group, block_size,
                   head_dim, MIN_PARTITION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, STORE: tl.constexpr,
                   HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
                   POOLS_BY_OFFSET: tl.constexpr, POOL_ALIGN: tl.constexpr):
    """Program (partition, request, kv head): attention of the request's one query, all heads of the group, over keys
    [partition * span, +span), where span splits the request's own context into num_partitions parts (whole BLOCK_N
    tiles, at least MIN_PARTITION keys): a long context keeps every program of the grid busy, whatever the block
    table's width. With STORE, the partition that holds the query's position first writes the step's key and value
    into the cache (slots < 0 are skipped). With one partition the program writes the output; with several it writes
    unnormalised partials (m in log2 units, l, acc) and counts its arrival, and the request's last partition to arrive
    combines them, in partition order, into the output. Partitions at or past seq_len neither store nor arrive (a
    padded row, seq_len 0, gets zeros from its first partition). With POOLS_BY_OFFSET the caches lie
    at the two offsets stored at pools_ptr, read at run time, from pools_ptr itself (k_cache_ptr and v_cache_ptr give
    only their type); the offsets keep its 16-byte alignment (POOL_ALIGN elements): the tile loads stay vectorised."""
    if POOLS_BY_OFFSET:
        anchor = pools_ptr.to(tl.pointer_type(k_cache_ptr.dtype.element_ty), bitcast=True)
        k_cache_ptr = anchor + tl.multiple_of(tl.load(pools_ptr), POOL_ALIGN)
        v_cache_ptr = anchor + tl.multiple_of(tl.load(pools_ptr + 1), POOL_ALIGN)
    part, req, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.minimum(tl.load(seq_lens_ptr + req), max_context)    # keys past the block table are never read
    q_tok = tl.load(query_start_loc_ptr + req)
    span = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_partitions), BLOCK_N) * BLOCK_N, MIN_PARTITION)
    part_start = part * span
    rows = tl.arange(0, BLOCK_M)
    g = rows % BLOCK_G
    row_valid = (rows < BLOCK_G) & (g < group)
    heads = kv_head * group + g
    d = tl.arange(0, BLOCK_D)
    q_mask = row_valid[:, None] & (d[None, :] < head_dim)
    out_offs = q_tok * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od
    if part_start >= seq_len:
        if part == 0:                                           # a padded row (seq_len 0): zeros
            tl.store(out_ptr + out_offs, tl.zeros([BLOCK_M, BLOCK_D], dtype=out_ptr.dtype.element_ty), mask=q_mask)
        return
    if STORE:
        if part == (seq_len - 1) // span:
            slot = tl.load(slot_ptr + q_tok)
            if slot >= 0:
                _store_kv_row(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, q_tok, kv_head, slot, d,
                              stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                              stride_cb, stride_cs, stride_ch, stride_cd, block_size, head_dim)
            tl.debug_barrier()          # the program's own tile loads below read them
    q = tl.load(q_ptr + q_tok * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd, mask=q_mask, other=0.0)
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (seq_len - 1)
    lo = part_start
    if HAS_WINDOW:
        lo = tl.maximum(lo, (tl.maximum(seq_len - window, 0) // BLOCK_N) * BLOCK_N)
    acc, m_i, l_i = _attend_range(q, k_cache_ptr, v_cache_ptr, block_tables_ptr + req * stride_bt, kv_head, lo,
                                  tl.minimum(part_start + span, seq_len), seq_len, q_pos, row_valid, scale,
                                  softcap, window, block_size, head_dim, stride_cb, stride_cs, stride_ch, stride_cd,
                                  BLOCK_M, BLOCK_N, BLOCK_D, HAS_SOFTCAP, HAS_WINDOW, PRECISION)
    if BLOCK_P == 1:
        tl.store(out_ptr + out_offs, (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(out_ptr.dtype.element_ty),
                 mask=q_mask)
    else:
        part_idx = (req * num_heads + heads) * num_partitions + part
        tl.store(m_ptr + part_idx, m_i, mask=row_valid)
        tl.store(l_ptr + part_idx, l_i, mask=row_valid)
        tl.store(acc_ptr + part_idx[:, None] * head_dim + d[None, :], acc, mask=q_mask)
        tl.debug_barrier()                                      # every thread's partials before the arrival
        counter = arrivals_ptr + req * num_kv_heads + kv_head
        used = tl.cdiv(seq_len, span)                           # the partitions that exist
        if tl.atomic_add(counter, 1, sem="acq_rel") == used - 1:
            tl.atomic_xchg(counter, 0)                          # zero again for the next launch
            _combine_partitions(out_ptr + out_offs, m_ptr, l_ptr, acc_ptr, (req * num_heads + heads) * num_partitions,
                                used, q_mask, row_valid, d, head_dim, BLOCK_M, BLOCK_D, BLOCK_P)


@triton.jit
def _combine_partitions(out_ptrs, m_ptr, l_ptr, acc_ptr, first_idx, used, q_mask, row_valid, d, head_dim,
                        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr):
    """Write sum_p w_p acc_p / sum_p w_p l_p over the first `used` partitions (w_p = 2^(m_p - max m)), in
    partition order. Partials are read from L2 (".cg"): other programs wrote them."""
    zero = tl.zeros([BLOCK_M], dtype=tl.int32)        # partition index + zero: a vector, for the masks
    m_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    for p in tl.static_range(BLOCK_P):
        valid = row_valid & (zero + p < used)
        m_max = tl.maximum(m_max, tl.load(m_ptr + first_idx + p, mask=valid, other=-1.0e30, cache_modifier=".cg"))
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    out = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for p in tl.static_range(BLOCK_P):
        valid = row_valid & (zero + p < used)
        w = tl.where(valid, tl.exp2(tl.load(m_ptr + first_idx + p, mask=valid, other=-1.0e30, cache_modifier=".cg")
                                    - m_max), 0.0)
        total += w * tl.load(l_ptr + first_idx + p, mask=valid, other=0.0, cache_modifier=".cg")
        out += w[:, None] * tl.load(acc_ptr + (first_idx + p)[:, None] * head_dim + d[None, :],
                                    mask=valid[:, None] & q_mask, other=0.0, cache_modifier=".cg")
    out = out / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=q_mask)


@triton.jit(do_not_specialize=["num_reqs"])     # no second variant for request counts divisible by 16
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
                    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
                    stride_cb, stride_cs, stride_ch, stride_cd, stride_bt,
                    num_reqs, scale, softcap, window, group, block_size, head_dim,
                    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr):
    """Program (query tile, kv head): BLOCK_M // BLOCK_G queries of one request x the heads of the group, over the
    request's cached context up to the tile's last query (earlier prefill chunks included). Request r owns the tiles
    from query_start_loc[r] // BLOCK_Q + r on, one per BLOCK_Q of its queries (the last one partial), so the grid
    depends only on the token and request counts; a tile past its request's queries exits at once."""
    BLOCK_Q: tl.constexpr = BLOCK_M // BLOCK_G
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    lo = tile * 0             # binary search: the last request whose first tile is at or before this one
    hi = lo + num_reqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        owns = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(owns, mid, lo)
        hi = tl.where(owns, hi, mid)
    req = lo
    seq_len = tl.load(seq_lens_ptr + req)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q0 = (tile - q_start // BLOCK_Q - req) * BLOCK_Q
    if q0 >= q_len:
        return
    rows = tl.arange(0, BLOCK_M)
    qi = q0 + rows // BLOCK_G
    g = rows % BLOCK_G
    row_valid = (qi < q_len) & (g < group)
    heads = kv_head * group + g
    tok = q_start + qi
    d = tl.arange(0, BLOCK_D)
    q_mask = row_valid[:, None] & (d[None, :] < head_dim)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=q_mask, other=0.0)
    ctx_start = seq_len - q_len   # position of the request's first query
    q_pos = ctx_start + qi
    lo = 0
    if HAS_WINDOW:
        lo = (tl.maximum(ctx_start + q0 - window + 1, 0) // BLOCK_N) * BLOCK_N
    hi = tl.minimum(seq_len, ctx_start + q0 + BLOCK_Q)
    acc, m_i, l_i = _attend_range(q, k_cache_ptr, v_cache_ptr, block_tables_ptr + req * stride_bt, kv_head, lo, hi, hi,
                                  q_pos, row_valid, scale, softcap, window, block_size, head_dim, stride_cb, stride_cs,
                                  stride_ch, stride_cd, BLOCK_M, BLOCK_N, BLOCK_D, HAS_SOFTCAP, HAS_WINDOW, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]   # seq_len 0 -> zeros
    tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, Hkv, D] into the caches at slot_mapping [T]; slots < 0 are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share a layout"
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        key, value, k_cache, v_cache, slot_mapping, *key.stride(), *value.stride(), *k_cache.stride(),
        k_cache.shape[1], head_dim, BLOCK_D=triton.next_power_of_2(head_dim))


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    sliding_window: int | None = None, softcap: float | None = None,
                    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    tuning: AttentionTuning = AttentionTuning(),
                    pool_offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over each request's cached context; returns [T, Hq, D] (contiguous).
    new_kv: (key, value [T, Hkv, D], slot_mapping [T]) stored into the caches first, as `store_kv` does; when every
    request brings one query (T == R: the split-K decode path, else the varlen prefill path), by the decode kernel
    itself: then each slot must be its request's own position seq_len - 1 (a block no other request of the batch reads),
    and padded rows store nothing. Precondition, not checked (that would synchronise): every request brings at least one
    query (a padded row: one query, seq_len 0, whose rows come back as zeros). pool_offsets: int64 [2] on the device,
    where k_cache and v_cache lie (a row of `PagedKVCache.pool_offsets`): the decode path reaches the caches through
    it at run time, so a captured decode step serves caches allocated again elsewhere (the offsets rewritten, the
    strides unchanged)."""
    num_tokens, num_heads, head_dim = query.shape
    num_reqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    assert num_heads % num_kv_heads == 0 and k_cache.stride() == v_cache.stride()
    out = query.new_empty(query.shape)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    common = dict(scale=scale, softcap=float(softcap or 0.0), window=int(sliding_window or 0), group=group,
                  block_size=k_cache.shape[1], head_dim=head_dim, BLOCK_G=triton.next_power_of_2(group),
                  BLOCK_D=max(16, triton.next_power_of_2(head_dim)), HAS_SOFTCAP=bool(softcap),
                  HAS_WINDOW=bool(sliding_window), PRECISION="ieee" if query.dtype == torch.float32 else "tf32")
    args = (query, k_cache, v_cache)
    if num_tokens == num_reqs:
        _decode(out, *args, block_tables, seq_lens, query_start_loc, new_kv, tuning, pool_offsets, common)
        return out
    if new_kv is not None:
        store_kv(*new_kv[:2], k_cache, v_cache, new_kv[2])
    block_m = max(tuning.prefill_block_m, common["BLOCK_G"])
    grid = (num_tokens // (block_m // common["BLOCK_G"]) + num_reqs, num_kv_heads)
    _prefill_kernel[grid](*args, out, block_tables, seq_lens, query_start_loc, *query.stride(), *out.stride(),
                          *k_cache.stride(), block_tables.stride(0), num_reqs, BLOCK_M=block_m,
                          BLOCK_N=tuning.prefill_block_n, num_warps=4, **common)
    return out


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def decode_partitions(max_context: int, num_programs: int, device: torch.device, tuning: AttentionTuning) -> int:
    """Split-K partitions of every request's context: few requests split finely enough to fill the GPU, many
    requests keep whole contexts (fewer partials to write and reduce); never more than partitions of
    tuning.partition_size keys cover max_context. Depends on shapes only."""
    wanted = triton.cdiv(tuning.decode_programs_per_sm * _sm_count(device), num_programs)
    return max(1, min(tuning.max_partitions, wanted, triton.cdiv(max_context, tuning.partition_size)))


_ARRIVALS: dict[torch.device, list[torch.Tensor]] = {}


def _arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counters, at least `count`, that the decode kernel leaves zeroed. Every buffer handed out stays
    allocated: a captured graph keeps its address. One buffer serves every decode launch on the device, so launches
    on the device must not run concurrently (on two streams at once); a driver's steps run on one stream."""
    buffers = _ARRIVALS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the decode kernel's arrival counters must be allocated before CUDA-graph capture "
                               "(a capture would record their zeroing, not run it): run a decode step of this "
                               "size uncaptured first")
        buffers.append(torch.zeros(max(count, 1024), dtype=torch.int32, device=device))
    return buffers[-1]


def _decode(out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, new_kv, tuning, pool_offsets,
            common):
    """Launch `_decode_kernel` over (partition, request, kv head), with its partials' buffers and arrival counters."""
    num_reqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    num_heads, head_dim = query.shape[1:]
    max_context = block_tables.shape[1] * k_cache.shape[1]
    num_partitions = decode_partitions(max_context, num_reqs * num_kv_heads, query.device, tuning)
    block_n = min(tuning.decode_block_n, tuning.partition_size)
    m = query.new_empty((num_reqs, num_heads, num_partitions), dtype=torch.float32)
    l = torch.empty_like(m)
    acc = query.new_empty((num_reqs, num_heads, num_partitions, head_dim), dtype=torch.float32)
    arrivals = _arrival_counters(query.device, num_reqs * num_kv_heads)
    key, value, slots = new_kv if new_kv is not None else (query, query, seq_lens)   # unread without a store
    _decode_kernel[(num_partitions, num_reqs, num_kv_heads)](
        query, key, value, k_cache, v_cache, k_cache if pool_offsets is None else pool_offsets, slots, block_tables,
        seq_lens, query_start_loc, out, m, l, acc, arrivals,
        *query.stride(), *key.stride(), *value.stride(), *out.stride(), *k_cache.stride(), block_tables.stride(0),
        num_heads, num_kv_heads, num_partitions, max_context,
        MIN_PARTITION=tuning.partition_size,
        BLOCK_M=max(16, common["BLOCK_G"]), BLOCK_N=block_n, BLOCK_P=triton.next_power_of_2(num_partitions),
        STORE=new_kv is not None, POOLS_BY_OFFSET=pool_offsets is not None, POOL_ALIGN=16 // k_cache.element_size(),
        num_warps=4, **common)
