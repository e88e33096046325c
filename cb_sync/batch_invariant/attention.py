"""Row-invariant paged attention: each query row's output depends on its own query and context only, whatever the
step (decode, a prefill chunk, a recompute after preemption) and whatever else is in it, for
`CBConfig(batch_invariant=True)`. On CUDA one Triton launch (`attention_kernel`, a program per row); elsewhere plain
torch, below, which is also the reference the kernel is tested against (the two round differently: one device, one
implementation, on the generator's side and the trainer's alike).

Rows go in blocks of `batch_invariant.ROWS` (padded), and each row's keys in blocks of KEYS_PER_BLOCK positions from
position 0 on, with an online softmax in fp32: every product and sum has one shape (batched matmuls of ROWS x heads
single-row products) and one order, and key blocks past a row's context leave its state untouched (not just
numerically: the state is kept). The same function serves the generator's paged cache and a trainer's full
sequences (`training_attention`)."""

from __future__ import annotations

import torch

from ..attention.metadata import AttnMetadata
from ..attention.sdpa_paged import store_kv, token_requests
from .ops import ROWS

DECODE_FOLLOWS_POOLS = False     # reads the pools from AttnMetadata's k_caches / v_caches

KEYS_PER_BLOCK = 64       # key positions per online-softmax block: the kernel's tile; plain torch takes whole cache
                          # blocks (key_block_pages)


def key_block_pages(block_size: int) -> int:
    """Cache blocks per key block: KEYS_PER_BLOCK // block_size, at least one (the generator and a trainer share
    the block size, so they share the key blocks)."""
    return max(1, KEYS_PER_BLOCK // block_size)


def row_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  row_tables: torch.Tensor, row_positions: torch.Tensor, scale: float,
                  sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """query [T, Hq, D]; block_tables [S, W]: each sequence's context blocks in order; row_tables [T]: the row's
    sequence (its row of block_tables); row_positions [T]: the row's position p (it sees keys 0..p, within the
    window); -1 marks a padded row (zeros out). Returns [T, Hq, D] in query's dtype."""
    if _kernel_serves(query):
        from . import attention_kernel
        return attention_kernel.row_attention(query, k_cache, v_cache, block_tables, row_tables, row_positions,
                                              scale, KEYS_PER_BLOCK, sliding_window, softcap)
    num_rows, num_heads, head_dim = query.shape
    pages = key_block_pages(k_cache.shape[1])
    width = -(-block_tables.shape[1] // pages) * pages
    if width != block_tables.shape[1]:
        block_tables = torch.nn.functional.pad(block_tables, (0, width - block_tables.shape[1]))
    padding = -num_rows % ROWS
    if padding:
        query = torch.cat([query, query.new_zeros(padding, num_heads, head_dim)])
        row_tables = torch.cat([row_tables, row_tables.new_zeros(padding)])
        row_positions = torch.cat([row_positions, row_positions.new_full((padding,), -1)])
    block_tables, row_tables = block_tables.long(), row_tables.long()
    outs = [_attend_block(query[i:i + ROWS], k_cache, v_cache, block_tables[row_tables[i:i + ROWS]],
                          row_positions[i:i + ROWS].long(), pages, scale, sliding_window, softcap)
            for i in range(0, query.shape[0], ROWS)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[:num_rows]


def _kernel_serves(query: torch.Tensor) -> bool:
    return query.is_cuda


def _attend_block(query, k_cache, v_cache, row_blocks, positions, pages, scale, sliding_window, softcap):
    """ROWS rows over their key blocks, in order, in fp32 (autocast off)."""
    with torch.autocast(query.device.type, enabled=False):
        return _attend_block_fp32(query, k_cache, v_cache, row_blocks, positions, pages, scale, sliding_window,
                                  softcap)


def _attend_block_fp32(query, k_cache, v_cache, row_blocks, positions, pages, scale, sliding_window, softcap):
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = query.shape[1] // num_kv_heads
    keys_per_block = pages * block_size
    q = query.float()
    best = q.new_full(q.shape[:2], float("-inf"))           # running max [ROWS, Hq]
    total = q.new_zeros(q.shape[:2])                        # running sum of exp
    acc = q.new_zeros(q.shape)                              # running weighted values [ROWS, Hq, D]
    offsets = torch.arange(keys_per_block, device=q.device)
    for first in range(0, row_blocks.shape[1], pages):
        blocks = row_blocks[:, first:first + pages]
        keys = k_cache[blocks].reshape(ROWS, keys_per_block, num_kv_heads, head_dim).float()
        values = v_cache[blocks].reshape(ROWS, keys_per_block, num_kv_heads, head_dim).float()
        keys = keys.repeat_interleave(group, dim=2).transpose(1, 2)          # [ROWS, Hq, K, D]
        values = values.repeat_interleave(group, dim=2).transpose(1, 2)
        key_pos = first * block_size + offsets
        allowed = key_pos[None, :] <= positions[:, None]                     # [ROWS, K]
        if sliding_window:
            allowed &= key_pos[None, :] > positions[:, None] - sliding_window
        scores = torch.matmul(q[:, :, None, :], keys.transpose(-1, -2))[:, :, 0] * scale   # [ROWS, Hq, K]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
        new_best = torch.maximum(best, scores.amax(-1))
        shift = torch.where(torch.isinf(new_best), torch.zeros_like(new_best), new_best)
        weights = torch.exp(scores - shift[..., None])
        decay = torch.exp(best - shift)
        new_total = total * decay + weights.sum(-1)
        values = values.masked_fill(~allowed[:, None, :, None], 0.0)
        new_acc = acc * decay[..., None] + torch.matmul(weights[:, :, None, :], values)[:, :, 0]
        seen = allowed.any(-1)[:, None]                                      # blocks past the context: state kept
        best = torch.where(seen, new_best, best)
        total = torch.where(seen, new_total, total)
        acc = torch.where(seen[..., None], new_acc, acc)
    out = acc / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    return out.masked_fill((positions < 0)[:, None, None], 0.0).to(query.dtype)


def store_and_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttnMetadata, layer: int,
                     scale: float, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """The backend entry point: store the step's K/V in layer's pools at meta's slots, then each row over its
    request's context."""
    k_cache, v_cache = meta.k_caches[layer], meta.v_caches[layer]
    if k_cache.is_cuda:                 # a kernel with no host synchronisation: decode steps are captured
        from ..attention.triton_kernels import store_kv as store_kv_on_device
        store_kv_on_device(key, value, k_cache, v_cache, meta.slot_mapping)
    else:
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    rows = meta.derived.get(__name__)
    if rows is None:                    # the tables, each row's request and position: the same in every layer
        q_lens, token_req, row = token_requests(meta.query_start_loc, query.shape[0])
        seq_lens = meta.seq_lens.long()[token_req]
        positions = torch.where(seq_lens > 0, seq_lens - q_lens[token_req] + row, torch.full_like(seq_lens, -1))
        blocks = -(-meta.max_seq_len // k_cache.shape[1])
        rows = meta.derived[__name__] = (meta.block_tables[:, :blocks], token_req.to(torch.int32),
                                         positions.to(torch.int32))
    return row_attention(query, k_cache, v_cache, *rows, scale, sliding_window, softcap)
