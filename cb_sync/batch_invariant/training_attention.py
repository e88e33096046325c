"""The row-invariant attention of the generator (`attention.row_attention`) over a trainer's full sequences, registered
with transformers' AttentionInterface as INVARIANT_IMPLEMENTATION: a token's attention output equals, bit for bit,
the generator's for the same token over the same context. Its backward recomputes masked attention with torch's
SDPA (the gradient of the same function; only the forward's bits are matched).

The forward's kwargs carry `cb_positions` [B, T]: each token's position in its sequence (the generator's), -1 for
padding; the sequences' keys are laid out in pages of the generator's block size from position 0 on."""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from .attention import row_attention

INVARIANT_IMPLEMENTATION = "cb_sync_invariant"


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] positions of a left- or right-padded batch's tokens as the generator counts them; -1 for padding."""
    mask = attention_mask.long()
    return torch.where(mask.bool(), mask.cumsum(-1) - 1, torch.full_like(mask, -1))


def _paged(key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, block_size: int):
    """key/value [B, Hkv, T, D] in pages [B * pages, block_size, Hkv, D], each sequence's tokens at their positions;
    with each sequence's pages [B, pages] and each token's sequence [B * T]."""
    batch, heads, length, dim = key.shape
    pages = -(-length // block_size)
    k_pages = key.new_zeros(batch * pages * block_size, heads, dim)
    v_pages = value.new_zeros(batch * pages * block_size, heads, dim)
    slots = (torch.arange(batch, device=key.device)[:, None] * pages * block_size + positions).flatten()
    real = positions.flatten() >= 0
    k_pages[slots[real]] = key.transpose(1, 2).reshape(-1, heads, dim)[real]
    v_pages[slots[real]] = value.transpose(1, 2).reshape(-1, heads, dim)[real]
    tables = torch.arange(batch * pages, device=key.device).view(batch, pages)
    row_tables = torch.arange(batch, device=key.device).repeat_interleave(length)
    shape = (batch * pages, block_size, heads, dim)
    return k_pages.view(shape), v_pages.view(shape), tables, row_tables


def _recomputed_attention(query, key, value, positions, scale, sliding_window, softcap):
    """Masked attention of [B, Hq, T, D] over [B, Hkv, T, D], differentiable: [B, T, Hq, D]. torch's SDPA (its fused
    backward) in the inputs' dtype, or without softcap support there, plain fp32 ops. Padded queries attend to
    their own key: their rows are garbage, but finite, and get no gradient."""
    q_pos, k_pos = positions[:, None, :, None], positions[:, None, None, :]
    allowed = (k_pos <= q_pos) & (k_pos >= 0)
    if sliding_window:
        allowed &= k_pos > q_pos - sliding_window
    allowed |= torch.eye(positions.shape[1], dtype=torch.bool, device=positions.device) & (q_pos < 0)
    group = query.shape[1] // key.shape[1]
    keys, values = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)   # SDPA's masked kernels want Hq
    if not softcap:
        out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=allowed, scale=scale)
        return out.transpose(1, 2)
    with torch.autocast(query.device.type, enabled=False):
        keys, values = keys.float(), values.float()
        scores = torch.tanh(torch.matmul(query.float(), keys.transpose(-1, -2)) * (scale / softcap)) * softcap
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return torch.matmul(probs, values).transpose(1, 2).to(query.dtype)


class _InvariantAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, positions, scale, sliding_window, softcap, block_size):
        ctx.save_for_backward(query, key, value, positions)
        ctx.settings = scale, sliding_window, softcap
        batch, heads, length, dim = query.shape
        k_pages, v_pages, tables, row_tables = _paged(key, value, positions, block_size)
        rows = query.transpose(1, 2).reshape(batch * length, heads, dim)
        out = row_attention(rows, k_pages, v_pages, tables, row_tables, positions.flatten(), scale, sliding_window,
                            softcap)
        return out.view(batch, length, heads, dim)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, positions = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (query, key, value)]
            out = _recomputed_attention(*inputs, positions, *ctx.settings)
            grads = torch.autograd.grad(out, inputs, grad_out)
        return (*grads, None, None, None, None, None)


def invariant_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask: torch.Tensor | None, scaling: float | None = None,
                                dropout: float = 0.0, sliding_window: int | None = None, softcap: float | None = None,
                                cb_positions: torch.Tensor | None = None, cb_block_size: int | None = None,
                                **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, Hq, T, D], key/value [B, Hkv, T, D] -> [B, T, Hq, D]; needs the cb_positions and cb_block_size
    kwargs (see the module). Attention dropout is not applied (the generator applies none)."""
    if cb_positions is None or cb_block_size is None:
        raise RuntimeError(f"{INVARIANT_IMPLEMENTATION} attention needs the cb_positions and cb_block_size kwargs; "
                           "CBSyncGRPOTrainer passes them in batch-invariant mode")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return _InvariantAttention.apply(query, key, value, cb_positions, scale, sliding_window, softcap,
                                     cb_block_size), None


AttentionInterface.register(INVARIANT_IMPLEMENTATION, invariant_attention_forward)
