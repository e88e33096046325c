"""cuDNN attention's run-time kernel builds, done at a forward's first use instead of in the middle of training.

On Hopper, PyTorch's SDPA takes cuDNN attention, which builds kernels at run time the first time it meets a kind of
call: lengths that are a multiple of 128 are one kind and the others another, and calls with a padding mask, or with
gradients, are kinds of their own. A new sequence length of a known kind costs a plan, a new kind a build that costs
far more; met mid-run, such a build stalls the step it falls in.

Before the trainer's first forward of each variety (with or without gradients, with or without padding),
`AttentionWarmup` runs that variety at one length of each kind (`warm_attention`), so every build the variety will
need happens at once, in its first step. Varieties a run never uses cost nothing. (The trainer calls it; a forward
hook on the model would change what a compiled decode step guards on, and cost it a recompile.)"""

from __future__ import annotations

import contextlib
import warnings

import torch

from ....engine.validation import learned_position_limit

WARM_LENGTHS = (128, 129)       # one length of each kind: a multiple of 128, and not


def prefers_cudnn_attention(model: torch.nn.Module) -> bool:
    """Whether the model's attention is PyTorch's SDPA with cuDNN attention enabled, on a CUDA device where cuDNN
    attention is SDPA's first choice (compute capability 9.0 and newer)."""
    config = getattr(model, "config", None)
    return (getattr(config, "_attn_implementation", None) == "sdpa" and torch.backends.cuda.cudnn_sdp_enabled()
            and _on_hopper_or_newer(model))


def _on_hopper_or_newer(model: torch.nn.Module) -> bool:
    device = next(model.parameters()).device
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (9, 0)


def reentrant_checkpointing(model: torch.nn.Module) -> bool:
    """Whether the model's layers recompute under reentrant gradient checkpointing, which refuses a backward to chosen
    inputs (torch's checkpoint is reentrant unless given use_reentrant=False)."""
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True and module.training:
            function = getattr(module, "_gradient_checkpointing_func", None)
            return getattr(function, "keywords", {}).get("use_reentrant") is not False
    return False


def warm_attention(model: torch.nn.Module, token_id: int, grad: bool, masked: bool) -> None:
    """Run the model on two rows of `token_id` at each of WARM_LENGTHS (those within a learned position table), with
    a padding mask (the second row left-padded by a token) or without; without gradients, or (grad) with a backward
    that reaches the input embeddings only. No parameter's gradient, no random-number state and no training flag
    changes."""
    limit = learned_position_limit(model.config.get_text_config())
    devices = sorted({p.device.index for p in model.parameters() if p.device.type == "cuda"})
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=devices):
        for length in (n for n in WARM_LENGTHS if limit is None or n <= limit):
            ids = torch.full((2, length), token_id, device=device)
            mask = torch.ones_like(ids)
            if masked:
                mask[1, 0] = 0
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
    `before_forward` warms a variety the first time it comes to a model that takes cuDNN attention
    (`prefers_cudnn_attention`). Under reentrant gradient checkpointing a gradient variety is warmed as its first pass
    runs, without gradients: its recompute and backward are not warmed. The warm-up only saves time, so a failure warns
    once and ends warming.

    Args:
        token_id: the token the warm-up's rows hold (the pad token).
        autocast: a callable giving the context manager the warmed forwards run under (the accelerator's autocast),
            so that the warm-up's calls are of the same kind.
    """

    def __init__(self, token_id: int, autocast=contextlib.nullcontext):
        self.token_id = token_id
        self.autocast = autocast
        self.seen: set[tuple[bool, bool]] = set()
        self.failed = False

    def pending(self, model: torch.nn.Module) -> bool:
        """Whether a variety with the current gradient mode is still to be warmed for `model`."""
        grad = torch.is_grad_enabled()
        return (not self.failed and not {(grad, False), (grad, True)} <= self.seen
                and prefers_cudnn_attention(model))

    def before_forward(self, model: torch.nn.Module, masked: bool) -> None:
        """Call before a forward of `model` (unwrapped) with the current gradient mode; masked: with padding."""
        variety = (torch.is_grad_enabled(), masked)
        if self.failed or variety in self.seen or not prefers_cudnn_attention(model):
            return
        self.seen.add(variety)
        grad = variety[0] and not reentrant_checkpointing(model)
        try:
            with self.autocast():
                warm_attention(model, self.token_id, grad=grad, masked=masked)
        except Exception as error:      # a speed-up only: never worth a failed run
            self.failed = True
            warnings.warn(f"cuDNN attention warm-up skipped from here on: {type(error).__name__}: {error}",
                          RuntimeWarning, stacklevel=2)
