"""The model's forward through torch.compile: one compile serves every step, from looked-up embeddings where that
gives the same logits, and the eager forward for good once a compile fails."""

from __future__ import annotations

import functools
import warnings

import torch
from torch._dynamo.exc import TorchDynamoException
from torch.fx.experimental import _config as shape_config
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

from ..attention import AttnMetadata
from ..model_patching.swaps import base_model

# independent elementwise kernels (the q and k norms and rotary embeddings, ...) in one launch: a decode step is
# bound by its launches
COMPILE_OPTIONS = {"combo_kernels": True}
MIN_COUNT = 2       # the fewest requests and rows kept of a compiled step: a count of one would be specialised into a
                    # compile of its own


def model_logits(model, inputs: dict, positions, meta: AttnMetadata, keep: torch.Tensor) -> torch.Tensor:
    """Logits of the token rows `keep`, from `input_ids` or `inputs_embeds`: what torch.compile may take."""
    return model(**inputs, position_ids=positions, cb_meta=meta, logits_to_keep=keep, use_cache=False).logits[0]


@functools.cache
def _compiled_model_logits():
    """One compiled function for every driver: dynamo caches per code object and guards on the model passed."""
    return torch.compile(model_logits, options=COMPILE_OPTIONS)


class CompiledForward:
    """`model_logits` of a model, compiled. Every count (tokens, requests, rows kept, cache blocks) is a dynamic
    dimension of its own, so one compile serves every bucket, cache size and step; a count of one would be
    specialised, so callers pass at least MIN_COUNT requests and rows kept (`compiled_buckets`, `pad_counts`), and
    run steps of over max_tokens eagerly. The
    block table's width is static: callers pad tables to the replay's width, and a call that widens it compiles
    again, as does each attention backend (one for decode, one for prompt tokens under "flash_prefill")."""

    def __init__(self, model: torch.nn.Module, max_tokens: int):
        self.model = model
        self.eager = eager_forward(model)
        self.max_tokens = max_tokens
        self.active = True            # False once a compile failed
        self.from_embeddings = None   # decided at the first call

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                 keep: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return self.eager(ids, positions, meta, keep)
        if self.from_embeddings is None:
            self.from_embeddings = self._same_logits_from_embeddings(ids, positions, meta, keep)
        inputs = {"inputs_embeds": self._embed(ids)} if self.from_embeddings else {"input_ids": ids}
        counted = (*inputs.values(), positions, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                   meta.query_start_loc, keep, *meta.k_caches, *meta.v_caches)
        for i, t in enumerate(counted):     # the token rows [1, T, ...] count on dimension 1, the others on 0
            torch._dynamo.mark_dynamic(t, 1 if i < 2 else 0)
        try:    # a decode step's counts are equal (tokens = requests = rows kept): duck shaping would make them one
            with shape_config.patch(use_duck_shape=False):
                return _compiled_model_logits()(self.model, inputs, positions, meta, keep)
        except (TorchDynamoException, ConstraintViolationError) as error:
            warnings.warn(f"torch.compile of the decode step failed, running it uncompiled: "
                          f"{type(error).__name__}: {str(error)[:300]}", RuntimeWarning, stacklevel=2)
            self.active = False
            return self.eager(ids, positions, meta, keep)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding lookup, outside the compiled function: hooks on the embedding layer (TRL's trainer adds
        one through `enable_input_require_grads`, calling `requires_grad_`) would break the compiled graph."""
        return base_model(self.model).get_input_embeddings()(ids)

    def _same_logits_from_embeddings(self, ids, positions, meta, keep) -> bool:
        """Whether the model's forward gives the same logits from looked-up embeddings as from the ids (not so
        for models with per-layer token inputs, such as Gemma-3n), checked uncompiled."""
        try:
            from_embeddings = model_logits(self.model, {"inputs_embeds": self._embed(ids)}, positions, meta, keep)
        except (RuntimeError, ValueError):      # a forward that refuses embeddings alone
            return False
        from_ids = self.eager(ids, positions, meta, keep)
        return bool(((from_ids == from_embeddings) | (from_ids.isnan() & from_embeddings.isnan())).all())


def compiled_buckets(compiled: CompiledForward | None,
                     buckets: list[int]) -> tuple[list[int], CompiledForward | None]:
    """The decode buckets a replay over `compiled` captures, and the forward of the other steps: without the bucket of
    one, compiled; or where it is the only bucket (max_batch_size=1), that bucket, and the other steps eager (only the
    replayed decode step is compiled)."""
    if compiled is None or buckets[-1] < MIN_COUNT:
        return buckets, None
    return [b for b in buckets if b >= MIN_COUNT], compiled


def pad_counts(columns) -> None:
    """Pad a step's columns (`scheduler.plan.StepColumns`) to MIN_COUNT requests and rows kept, for the compiled
    forward: the padding requests read and store nothing, the padding rows repeat the last row kept."""
    columns.pad_requests(MIN_COUNT)
    columns.keep += (columns.keep[-1:] or [0]) * (MIN_COUNT - len(columns.keep))


def eager_forward(model: torch.nn.Module):
    """`model_logits` of a model from its token ids, uncompiled, with a CompiledForward's signature."""
    return lambda ids, positions, meta, keep: model_logits(model, {"input_ids": ids}, positions, meta, keep)
