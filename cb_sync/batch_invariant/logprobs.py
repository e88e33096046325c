"""The trainer's logprobs (and entropies) of chosen tokens in the exact mode: the sampler's op
(`sampling.chosen_logprobs` over logits / temperature, in fp32, its log_softmax in invariant row blocks), so they
equal the generator's bit for bit, over the rows CHUNK_ROWS at a time. Each fp32 copy of the logits then spans a
chunk, not the batch (a batch of 6,400 scored tokens over a 151,936-token vocabulary is 3.9 GB in fp32 a copy), and
backward keeps the logits alone and recomputes the softmax a chunk at a time."""

from __future__ import annotations

import torch

from ..sampling import chosen_logprobs
from .ops import ROWS, invariant_ops

CHUNK_ROWS = 8 * ROWS       # a multiple of the invariant ops' row block: chunking adds no padded rows


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, entropies: bool = False,
                   entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs [R] of tokens [R] under log_softmax(logits [R, V] / temperature), as the sampler computes them, and
    where asked the entropies [R] of the same distributions. Differentiable in logits; the entropies only with
    entropy_grad (an entropy bonus in the loss)."""
    temperatures = torch.full((1, 1), temperature, dtype=torch.float32, device=logits.device)
    logps, ents = _TokenLogprobs.apply(logits, tokens, temperatures, entropies, entropy_grad)
    return logps, ents if entropies else None


def _scaled(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    return logits.float() / temperatures


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, temperatures, entropies, entropy_grad):
        ctx.save_for_backward(logits, tokens, temperatures)
        ctx.entropies = entropies
        logps = logits.new_empty(logits.shape[0], dtype=torch.float32)
        ents = logits.new_zeros(logits.shape[0] if entropies else 0, dtype=torch.float32)
        for start in range(0, logits.shape[0], CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            scaled = _scaled(logits[rows], temperatures)
            with invariant_ops():
                logps[rows] = chosen_logprobs(scaled, tokens[rows])
            if entropies:
                log_probs = torch.log_softmax(scaled, dim=-1)
                ents[rows] = -(log_probs.exp() * log_probs).sum(-1)
        if not entropy_grad:
            ctx.mark_non_differentiable(ents)
        return logps, ents

    @staticmethod
    def backward(ctx, grad_logps, grad_ents):
        """d logp / d z = onehot - p and d H / d z = -p (log p + H) for z = logits / temperature."""
        logits, tokens, temperatures = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            log_probs = torch.log_softmax(_scaled(logits[rows], temperatures), dim=-1)
            probs = log_probs.exp()
            chunk = probs * -grad_logps[rows, None]
            chunk.scatter_add_(1, tokens[rows, None], grad_logps[rows, None])
            if ctx.entropies and grad_ents is not None:
                entropy = -(probs * log_probs).sum(-1, keepdim=True)
                chunk -= grad_ents[rows, None] * probs * (log_probs + entropy)
            grad[rows] = chunk.div_(temperatures)
        return grad, None, None, None, None
