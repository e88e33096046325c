"""The row-invariant attention of the generator (`attention.row_attention`) over a trainer's sequences, registered
with transformers' AttentionInterface as INVARIANT_IMPLEMENTATION: a token's attention output equals, bit for bit,
the generator's for the same token over the same context. Its backward recomputes causal attention with torch's SDPA
(the gradient of the same function; only the forward's bits are matched), each sequence in a row of its own so that
SDPA's fused causal kernels serve.

The forward's kwargs carry `cb_pages` (`TrainingPages`): where each token's key and value go in pages of the
generator's block size, each sequence's from position 0 on. The tokens may be a padded batch [B, T] or several
sequences packed into one row [1, N] (`packing`): only the pages say which token belongs to which sequence."""

from __future__ import annotations

import dataclasses

import torch
from transformers import AttentionInterface

from .attention import row_attention

INVARIANT_IMPLEMENTATION = "cb_sync_invariant"


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] positions of a left- or right-padded batch's tokens as the generator counts them; -1 for padding."""
    mask = attention_mask.long()
    return torch.where(mask.bool(), mask.cumsum(-1) - 1, torch.full_like(mask, -1))


@dataclasses.dataclass(frozen=True)
class TrainingPages:
    """Where a forward's tokens (flattened, [B * T]) sit in pages of block_size positions: each sequence owns
    `tables.shape[1]` pages in a row of `tables` (the first of them at position 0), so its slots are also a row of
    a [sequences, tables.shape[1] * block_size] layout by position. Padding tokens have position -1 and no slot. The
    real tokens and their slots are found once a forward, so that no layer's copy into pages waits on the host."""

    positions: torch.Tensor      # [B * T] each token's position in its sequence
    sequences: torch.Tensor      # [B * T] each token's sequence (its row of tables)
    real: torch.Tensor           # [R] the indices of the real tokens (position >= 0)
    real_slots: torch.Tensor     # [R] their slots: sequence * width + position
    tables: torch.Tensor         # [sequences, pages]
    block_size: int

    @property
    def width(self) -> int:
        """Positions a sequence's pages hold."""
        return self.tables.shape[1] * self.block_size


def training_pages(positions: torch.Tensor, sequences: torch.Tensor, num_sequences: int, longest: int,
                   block_size: int) -> TrainingPages:
    """The pages of tokens at positions [B, T] (-1: padding) of sequences [B, T] (0 .. num_sequences - 1), the longest
    sequence `longest` tokens; computed once a forward, for every layer."""
    pages = max(1, -(-longest // block_size))
    positions, sequences = positions.flatten(), sequences.flatten()
    real = (positions >= 0).nonzero()[:, 0]
    real_slots = sequences[real] * pages * block_size + positions[real]
    tables = torch.arange(num_sequences * pages, device=positions.device).view(num_sequences, pages)
    return TrainingPages(positions, sequences, real, real_slots, tables, block_size)


def _paged(tokens: torch.Tensor, pages: TrainingPages) -> torch.Tensor:
    """tokens [N, H, D] (N = B * T) in pages [pages, block_size, H, D] at their slots; zeros elsewhere."""
    heads, dim = tokens.shape[1:]
    out = tokens.new_zeros(pages.tables.numel() * pages.block_size, heads, dim)
    out.index_copy_(0, pages.real_slots, tokens.index_select(0, pages.real))
    return out.view(-1, pages.block_size, heads, dim)


def _by_sequence(tokens: torch.Tensor, pages: TrainingPages) -> torch.Tensor:
    """tokens [N, H, D] as [sequences, H, width, D]: each sequence's tokens by position, zeros past its end."""
    return _paged(tokens, pages).view(pages.tables.shape[0], pages.width, *tokens.shape[1:]).transpose(1, 2)


def _from_sequences(rows: torch.Tensor, pages: TrainingPages) -> torch.Tensor:
    """[sequences, H, width, D] back to the tokens' order [N, H, D] (zeros for padding tokens)."""
    flat = rows.transpose(1, 2).reshape(-1, *rows.shape[1:2], rows.shape[-1])
    out = flat.new_zeros(pages.positions.shape[0], *flat.shape[1:])
    return out.index_copy_(0, pages.real, flat.index_select(0, pages.real_slots))


def _causal_attention(query, key, value, scale, sliding_window, softcap):
    """Causal attention of sequences [S, Hq, L, D] over [S, Hkv, L, D] (each from position 0 on), differentiable.
    torch's SDPA (its fused backward) in the inputs' dtype, or with softcap, plain fp32 ops. Positions past a
    sequence's end hold zeros: real queries never see them, and their own rows get no gradient."""
    group = query.shape[1] // key.shape[1]
    keys, values = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    length = query.shape[2]
    if not sliding_window and not softcap:
        return torch.nn.functional.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale)
    positions = torch.arange(length, device=query.device)
    allowed = positions[None, :] <= positions[:, None]
    if sliding_window:
        allowed &= positions[None, :] > positions[:, None] - sliding_window
    if not softcap:
        return torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=allowed, scale=scale)
    with torch.autocast(query.device.type, enabled=False):
        scores = torch.tanh(torch.matmul(query.float(), keys.float().transpose(-1, -2)) * (scale / softcap)) * softcap
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return torch.matmul(probs, values.float()).to(query.dtype)


class _InvariantAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, pages, scale, sliding_window, softcap):
        """query [B, Hq, T, D], key / value [B, Hkv, T, D] -> [B, T, Hq, D]."""
        batch, heads, length, dim = query.shape
        tokens = query.transpose(1, 2).reshape(batch * length, heads, dim)
        keys, values = (t.transpose(1, 2).reshape(batch * length, *t.shape[1:2], dim) for t in (key, value))
        ctx.save_for_backward(tokens, keys, values)
        ctx.pages, ctx.settings, ctx.shape = pages, (scale, sliding_window, softcap), query.shape
        out = row_attention(tokens, _paged(keys, pages), _paged(values, pages), pages.tables, pages.sequences,
                            pages.positions, scale, sliding_window, softcap)
        return out.view(batch, length, heads, dim)

    @staticmethod
    def backward(ctx, grad_out):
        tokens, keys, values = ctx.saved_tensors
        pages, (batch, heads, length, dim) = ctx.pages, ctx.shape
        with torch.enable_grad():
            inputs = [_by_sequence(t, pages).detach().requires_grad_() for t in (tokens, keys, values)]
            out = _causal_attention(*inputs, *ctx.settings)
            grad = _by_sequence(grad_out.reshape(batch * length, heads, dim), pages)
            grads = torch.autograd.grad(out, inputs, grad)
        grad_q, grad_k, grad_v = (_from_sequences(g, pages).view(batch, length, -1, dim).transpose(1, 2)
                                  for g in grads)
        return grad_q, grad_k, grad_v, None, None, None, None


def invariant_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask: torch.Tensor | None, scaling: float | None = None,
                                dropout: float = 0.0, sliding_window: int | None = None, softcap: float | None = None,
                                cb_pages: TrainingPages | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, Hq, T, D], key/value [B, Hkv, T, D] -> [B, T, Hq, D]; needs the cb_pages kwarg (see the module).
    Attention dropout is not applied (the generator applies none)."""
    if cb_pages is None:
        raise RuntimeError(f"{INVARIANT_IMPLEMENTATION} attention needs the cb_pages kwarg; CBSyncGRPOTrainer passes "
                           "it in batch-invariant mode")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return _InvariantAttention.apply(query, key, value, cb_pages, scale, sliding_window, softcap), None


AttentionInterface.register(INVARIANT_IMPLEMENTATION, invariant_attention_forward)
