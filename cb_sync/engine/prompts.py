"""Prompts as users pass them, made token rows: lists of ids, a 2-D tensor or array, or a tokenizer's encoding with
its attention_mask, each padded row cut to its unmasked tokens; padding that comes without its mask is refused."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..config import as_int


def prompt_rows(prompts, attention_mask=None, pad_ids: frozenset[int] = frozenset()) -> list[Sequence]:
    """The prompts as a list of token sequences, each row of a padded batch cut to the tokens its mask keeps.

    Args:
        prompts: lists of token ids, a 2-D tensor or array, or a tokenizer's encoding (a BatchEncoding or dict with
            `input_ids`, and `attention_mask` where padded).
        attention_mask: the 0/1 rows of a padded batch (left or right padding), beside its ids.
        pad_ids: the ids a padded 2-D prompt would start or end with (`pad_ids`); such a prompt without a mask
            is refused.

    Returns:
        One sequence of token ids per prompt, unchecked (`validation.build_requests` checks the ids).

    Raises:
        ValueError: prompts that are not a list of sequences, a mask that does not fit them or is not one run of 1s
            a row, a mask given twice, or a padded 2-D prompt without its mask; naming the request.
    """
    if isinstance(prompts, Mapping) and "input_ids" in prompts:
        if attention_mask is not None and prompts.get("attention_mask") is not None:
            raise ValueError("attention_mask given twice: in the prompts' encoding and as an argument")
        attention_mask = prompts.get("attention_mask", attention_mask)
        prompts = prompts["input_ids"]
    rows = _rows(prompts, "prompts must be a list of token-id lists", "a prompt must be a list of token ids")
    if attention_mask is not None:
        return [row[start:stop] for row, (start, stop) in zip(rows, _unmasked_spans(attention_mask, rows))]
    if pad_ids and getattr(prompts, "ndim", None) == 2:
        padded = [index for index, row in enumerate(rows) if row and (row[0] in pad_ids or row[-1] in pad_ids)]
        if padded:
            shown = ", ".join(map(str, padded[:8])) + (", ..." if len(padded) > 8 else "")
            pads = " or ".join(map(str, sorted(pad_ids)))
            raise ValueError(f"rows [{shown}] of the 2-D prompt start or end with the pad token id {pads} and come "
                             "without an attention_mask: pass the tokenizer's encoding whole (input_ids and "
                             "attention_mask), attention_mask=, or the prompts unpadded as lists of token ids")
    return rows


def pad_ids(model: torch.nn.Module) -> frozenset[int]:
    """The ids that pad a batch for `model` (a transformers model): its generation config's or config's pad token,
    else its EOS ids, which HF generate pads with where no pad token is named; empty where neither is."""
    configs = (getattr(model, "generation_config", None), model.config, model.config.get_text_config())
    for name in ("pad_token_id", "eos_token_id"):
        for config in configs:
            value = getattr(config, name, None)
            ids = {as_int(v) for v in (value if isinstance(value, (list, tuple)) else [value])} - {None}
            if ids:
                return frozenset(ids)
    return frozenset()


def _rows(given, not_rows: str, not_row: str) -> list[Sequence]:
    """`given` (a list of sequences, or a tensor or array) as a list of sequences; ValueError `not_rows` or, naming
    the request, `not_row`."""
    rows = given.tolist() if hasattr(given, "tolist") else given
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise ValueError(f"{not_rows}, got {type(given).__name__}")
    listed = [row.tolist() if hasattr(row, "tolist") else row for row in rows]
    for index, (row, original) in enumerate(zip(listed, rows)):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise ValueError(f"request {index}: {not_row}, got {type(original).__name__}")
    return listed


def _unmasked_spans(attention_mask, rows: list[Sequence]) -> list[tuple[int, int]]:
    """(start, stop) of each row's 1s in the mask: one run a row, the padding before or after it."""
    mask = _rows(attention_mask, "attention_mask must be a list of 0/1 rows", "an attention_mask row must be a list")
    if len(mask) != len(rows):
        raise ValueError(f"attention_mask has {len(mask)} rows for {len(rows)} prompts")
    spans = []
    for index, (keep, row) in enumerate(zip(mask, rows)):
        if len(keep) != len(row):
            raise ValueError(f"request {index}: attention_mask row of {len(keep)} values for a prompt of {len(row)} "
                             "tokens")
        bad = next((v for v in keep if v not in (0, 1)), None)
        if bad is not None:
            raise ValueError(f"request {index}: attention_mask values must be 0 or 1, got {bad!r}")
        ones = [position for position, v in enumerate(keep) if v]
        if ones and len(ones) != ones[-1] - ones[0] + 1:
            raise ValueError(f"request {index}: attention_mask {list(map(int, keep))} is not one run of 1s (left or "
                             "right padding)")
        spans.append((ones[0], ones[-1] + 1) if ones else (0, 0))
    return spans
