"""cuDNN attention's run-time kernel builds, done at a forward's first use instead of in the middle of training.

On Hopper, PyTorch's SDPA takes cuDNN attention, which builds kernels at run time the first time it meets a kind of
call. On an H200 (`benchmarks/results/sdpa_kinds.md`): a new sequence length costs a plan, 40-140 ms, while the first
length of a new kind costs ~0.7-1 s without gradients and ~1.7-1.9 s with a backward; lengths that are a multiple of
128 are one kind and the others another, and calls with a padding mask, or with gradients, are kinds of their own. In a
GRPO run whose forwards are 639-643 tokens wide, the first multiple of 128 came at step 8 and cost 2.3 s more than its
neighbours (`benchmarks/results/grpo_training_g.md`).

Before the trainer's first forward of each variety (with or without gradients, with or without padding),
`AttentionWarmup` runs that variety at one length of each kind (`warm_attention`), so every build the variety will
need happens at once, in its first step. Varieties a run never uses cost nothing. (The trainer calls it; a forward
hook on the model would change what a compiled decode step guards on, and cost it a recompile.)"""

from __future__ import annotations

import torch

WARM_LENGTHS = (128, 129)       # one length of each kind: a multiple of 128, and not


def wants_warmup(model: torch.nn.Module) -> bool:
    """Whether the model's attention is PyTorch's SDPA on a CUDA device with cuDNN attention enabled."""
    config = getattr(model, "config", None)
    return (getattr(config, "_attn_implementation", None) == "sdpa" and torch.backends.cuda.cudnn_sdp_enabled()
            and next(model.parameters()).device.type == "cuda")


def warm_attention(model: torch.nn.Module, token_id: int, grad: bool, masked: bool,
                   lengths: tuple[int, ...] = WARM_LENGTHS) -> None:
    """Run the model on two rows of `token_id` at each length, with a padding mask (the second row left-padded by a
    token) or without; without gradients, or (grad) with a backward that reaches the input embeddings only. No
    parameter's gradient, no random-number state and no training flag changes."""
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for length in lengths:
            ids = torch.full((2, length), token_id, device=device)
            mask = torch.ones_like(ids)
            mask[1, 0] = 0 if masked else 1
            if not grad:
                with torch.no_grad():
                    model(input_ids=ids, attention_mask=mask, logits_to_keep=1, use_cache=False)
                continue
            with torch.enable_grad():
                embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
                logits = model(inputs_embeds=embeds, attention_mask=mask, logits_to_keep=1, use_cache=False).logits
                torch.autograd.grad(logits.float().sum(), embeds)


class AttentionWarmup:
    """Remembers which varieties of forward (gradients on or off, padding mask or none) a trainer has run:
    `before_forward` warms a variety the first time it comes (`warm_attention`), where the model is on SDPA with cuDNN
    attention on CUDA (`wants_warmup`). backward=False warms gradient forwards without their backward (reentrant
    gradient checkpointing refuses a backward to chosen inputs)."""

    def __init__(self, token_id: int, backward: bool = True):
        self.token_id, self.backward = token_id, backward
        self.seen: set[tuple[bool, bool]] = set()

    def pending(self) -> bool:
        """Whether a variety with the current gradient mode is still to come."""
        grad = torch.is_grad_enabled()
        return not {(grad, False), (grad, True)} <= self.seen

    def before_forward(self, model: torch.nn.Module, masked: bool) -> None:
        """Call before a forward of `model` (unwrapped) with the current gradient mode; masked: with padding."""
        variety = (torch.is_grad_enabled(), masked)
        if variety in self.seen:
            return
        self.seen.add(variety)
        if wants_warmup(model):
            warm_attention(model, self.token_id, grad=variety[0] and self.backward, masked=masked)
