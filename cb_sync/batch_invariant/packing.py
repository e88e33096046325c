"""A trainer's padded batch packed into one row for the exact mode's forward: the real tokens of a left- and / or
right-padded batch [B, T], row after row, each sequence at its own positions from 0, so the forward computes no
padding (TRL pads a rollout's rows to its longest prompt and its longest completion: up to half a batch's columns).
Every op of the exact mode is row-invariant and its attention reads each sequence's pages alone
(`training_attention`), so a packed token gets the bits it gets in the padded batch, and the generator's.

Only the tokens whose next token is scored reach the LM head (the generator also computes logits only where it
samples), and the scores go back to the padded batch's [B, logits_to_keep] layout (`PackedBatch.unpacked`)."""

from __future__ import annotations

import dataclasses

import torch

from .training_attention import TrainingPages, positions_from_mask, training_pages


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor        # [1, N] the batch's real tokens, row after row
    position_ids: torch.Tensor     # [1, N] each token's position in its sequence
    pages: TrainingPages           # the attention's pages of the packed tokens
    predicting: torch.Tensor       # [C] packed index of each token whose next token is scored (C >= 1)
    targets: torch.Tensor          # [C] the token each of those predicts
    scored: torch.Tensor           # [S] the scored tokens' flat index in [B, logits_to_keep] (S = C, or 0)
    shape: tuple[int, int]         # (B, logits_to_keep)

    def unpacked(self, values: torch.Tensor) -> torch.Tensor:
        """values [C] of the scored tokens as [B, logits_to_keep], zeros elsewhere; differentiable."""
        out = values.new_zeros(self.shape[0] * self.shape[1])
        return out.index_copy(0, self.scored, values[:self.scored.numel()]).view(self.shape)


def packed_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                 block_size: int) -> PackedBatch:
    """input_ids / attention_mask [B, T], left- or right-padded (or both), packed; the tokens scored are those of the
    last logits_to_keep columns that are real and follow a real token. Where none is, the first token's next token
    is computed anyway (and dropped), so that the forward has an output to differentiate. block_size: the
    generator's (its attention's pages)."""
    rows, length = input_ids.shape
    mask = attention_mask.bool()
    flat = mask.flatten()
    real = flat.nonzero()[:, 0]
    packed_index = flat.long().cumsum(0) - 1
    sequences = torch.arange(rows, device=input_ids.device).repeat_interleave(length)[real]
    positions = positions_from_mask(attention_mask).flatten()[real]
    longest = int(mask.sum(1).max()) if rows else 0
    pages = training_pages(positions, sequences, rows, longest, block_size)

    first = length - logits_to_keep
    follows_real = torch.cat([mask.new_zeros(rows, 1), mask[:, :-1]], dim=1)
    scored = (mask & follows_real)[:, first:].flatten().nonzero()[:, 0]
    row, column = scored // logits_to_keep, scored % logits_to_keep + first
    predicting, targets = packed_index[row * length + column - 1], input_ids[row, column]
    if scored.numel() == 0:
        predicting, targets = packed_index[real[:1]], input_ids.flatten()[real[:1]]
    return PackedBatch(input_ids.flatten()[real][None], positions[None], pages, predicting, targets, scored,
                       (rows, logits_to_keep))
