"""Reference paged attention in plain torch: gathers each request's K/V from its blocks. Exact, slow, CPU-friendly."""

from __future__ import annotations

import torch

from .metadata import AttnMetadata

DECODE_FOLLOWS_POOLS = False     # reads the pools from AttnMetadata's k_caches / v_caches


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, Hkv, D] into the caches at slot_mapping [T]; slots < 0 are skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[valid].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[valid].to(v_cache.dtype)


def token_requests(query_start_loc: torch.Tensor, num_tokens: int):
    """(queries per request [R], each token's request [T], each token's index among its request's queries [T]) of a
    flat batch; no host synchronisation."""
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    token_req = torch.repeat_interleave(torch.arange(q_lens.numel(), device=q_lens.device), q_lens,
                                        output_size=num_tokens)
    return q_lens, token_req, torch.arange(num_tokens, device=q_lens.device) - query_start_loc[token_req].long()


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                    scale: float, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over each request's cached context, [T, Hq, D]: a query at position p sees
    keys k <= p (and k > p - sliding_window with a window); padded requests' rows (seq_len 0) come back as zeros."""
    num_tokens, num_heads, head_dim = query.shape
    num_reqs, device = seq_lens.numel(), query.device
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_tokens == 0 or max_seq_len == 0:
        return torch.zeros_like(query)
    q_lens, token_req, token_row = token_requests(query_start_loc, num_tokens)
    q_pad = query.new_zeros(num_reqs, max_query_len, num_heads, head_dim)
    q_pad[token_req, token_row] = query
    num_ctx_blocks = -(-max_seq_len // block_size)
    blocks = block_tables[:, :num_ctx_blocks].long()
    keys = k_cache[blocks].reshape(num_reqs, -1, num_kv_heads, head_dim)[:, :max_seq_len].to(query.dtype)
    values = v_cache[blocks].reshape(num_reqs, -1, num_kv_heads, head_dim)[:, :max_seq_len].to(query.dtype)
    group = num_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=2).transpose(1, 2)      # [R, Hq, K, D]
    values = values.repeat_interleave(group, dim=2).transpose(1, 2)
    scores = torch.matmul(q_pad.transpose(1, 2), keys.transpose(-1, -2)).float() * scale   # [R, Hq, Q, K]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    seq = seq_lens.long()[:, None, None]
    q_pos = (seq - q_lens[:, None, None]) + torch.arange(max_query_len, device=device)[None, :, None]
    k_pos = torch.arange(max_seq_len, device=device)[None, None, :]
    allowed = (k_pos <= q_pos) & (k_pos < seq)
    if sliding_window:
        allowed &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~allowed[:, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values).transpose(1, 2)                  # [R, Q, Hq, D]
    out = out[token_req, token_row]
    return out.masked_fill((seq_lens[token_req] == 0)[:, None, None], 0.0)


def store_and_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttnMetadata, layer: int,
                     scale: float, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """The backend entry point: store the step's K/V in layer's pools at meta's slots, then paged attention over
    meta's batch."""
    k_cache, v_cache = meta.k_caches[layer], meta.v_caches[layer]
    store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    return paged_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                           meta.max_query_len, meta.max_seq_len, scale, sliding_window, softcap)
