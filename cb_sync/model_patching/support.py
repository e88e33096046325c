"""Which models cb_sync can drive, checked once when a driver is built: a decoder-only transformers model whose
layers are attention layers, each reached by cb_sync's paged attention with the step's batch metadata."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..attention import ATTN_IMPLEMENTATION, MissingBatchMetadata
from .generation_mode import attention_implementations, generation_mode, restore_attention
from .swaps import base_model

# layer kinds (a config's `layer_types`) whose whole state is their K/V, which the cache pages; others (linear
# attention, Mamba, convolutions) keep a state of their own, which a step would lose
PAGED_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


def check_supported(model: torch.nn.Module) -> None:
    """Refuse, before any work, a model cb_sync cannot generate from; leave the model as it was.

    Args:
        model: the model given to the driver.

    Raises:
        ValueError: naming the model's class and why: not a transformers model, an encoder-decoder, no attention
            layers or layers with a state of their own (Mamba, linear attention), attention that does not go
            through transformers' AttentionInterface (it would run the flat batch as one sequence), or a forward
            that does not pass the batch metadata on to it (Falcon).
    """
    base = base_model(model)
    if not isinstance(base, PreTrainedModel):
        raise ValueError(f"the model must be a transformers PreTrainedModel (or a PEFT model of one), got "
                         f"{type(base).__name__}")
    name, text_config = type(base).__name__, base.config.get_text_config()
    if getattr(base.config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model: cb_sync generates from decoder-only causal LMs")
    missing = [key for key in ("num_hidden_layers", "num_attention_heads") if getattr(text_config, key, None) is None]
    if missing:
        raise ValueError(f"{name} has no attention layers cb_sync can page: its config names no "
                         f"{' or '.join(missing)}")
    stateful = sorted(set(getattr(text_config, "layer_types", None) or ()) - PAGED_LAYER_TYPES)
    if stateful:
        raise ValueError(f"{name} has layers of type {stateful}, whose state cb_sync's paged KV cache does not hold")
    previous = attention_implementations(base.config)
    base.set_attn_implementation(ATTN_IMPLEMENTATION)
    switched = base.config._attn_implementation == ATTN_IMPLEMENTATION
    restore_attention(previous)
    if not switched:
        raise ValueError(f"{name} does not route attention through transformers' AttentionInterface, so cb_sync "
                         "cannot supply paged attention to it")
    _check_attention_reached(model, name)


class _AttentionProbe:
    """Stands in for a step's batch metadata and its backend: records the layers whose attention it reaches and
    gives zeros as their output."""

    def __init__(self):
        self.backend = self
        self.layers = []

    def store_and_attend(self, query, key, value, meta, layer, scale, sliding_window=None, softcap=None):
        self.layers.append(layer)
        return query.new_zeros(*query.shape[:2], value.shape[-1])


def _check_attention_reached(model: torch.nn.Module, name: str) -> None:
    """A one-token forward as a step runs it: some models switch to the paged attention but drop, on the way down
    to it, the keyword arguments that carry the batch metadata (Falcon), or fail around it; found here, not in a
    call."""
    probe = _AttentionProbe()
    ids = torch.zeros((1, 1), dtype=torch.long, device=base_model(model).get_input_embeddings().weight.device)
    try:
        with generation_mode(model):
            model(input_ids=ids, position_ids=ids, cb_meta=probe, logits_to_keep=1, use_cache=False)
    except MissingBatchMetadata:
        raise ValueError(f"{name}'s forward does not pass cb_sync's batch metadata (cb_meta) on to its attention "
                         "layers, so its paged attention cannot run") from None
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        raise ValueError(f"{name} cannot run on cb_sync's paged attention: a one-token forward with it raised "
                         f"{type(error).__name__}: {error}") from error
    if not probe.layers:
        raise ValueError(f"{name} has no layer that calls attention through transformers' AttentionInterface")
