"""generate()'s input checks: Requests from prompts and params, lengths against the model and the cache."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from ..config import SamplingParams, as_int, seed_int
from .kv_cache import blocks_for
from .request import Request


def build_requests(prompts, params, seed: int | None, vocab_size: int, generation_config) -> list[Request]:
    """One Request per prompt (a 2-D tensor or array gives its rows); a request without a seed of its own draws one
    from `seed` (None: torch's global RNG). Errors are ValueErrors naming the request and the bad value."""
    rows = prompt_rows(prompts)
    params = SamplingParams() if params is None else params
    if isinstance(params, SamplingParams):
        params = [params] * len(rows)
    elif isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
        raise ValueError(f"params must be a SamplingParams or a list of one per prompt, got {type(params).__name__}")
    elif len(params) != len(rows):
        raise ValueError(f"got {len(params)} SamplingParams for {len(rows)} prompts")
    seed = seed_int(seed)
    checked = set()
    for index, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"request {index}: params must be SamplingParams, got {type(p).__name__}")
        if id(p) not in checked:                      # again: a dataclass may have been changed since it was built
            checked.add(id(p))
            try:
                p.__post_init__()
            except ValueError as error:
                raise ValueError(f"request {index}: {error}") from None
    prompts = [_check_prompt(index, prompt, vocab_size) for index, prompt in enumerate(rows)]
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    seeds = iter(torch.randint(0, 2**62, (sum(p.seed is None for p in params),), generator=generator).tolist())
    default_eos = generation_config.eos_token_id if generation_config is not None else None
    requests = []
    for index, (tokens, p) in enumerate(zip(prompts, params)):
        eos = p.eos_token_id if p.eos_token_id is not None else default_eos
        eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        requests.append(Request(index, tokens, p, p.seed if p.seed is not None else next(seeds), eos_ids))
    return requests


def prompt_rows(prompts) -> list[Sequence]:
    """The prompts as a list of token sequences (a tensor or array gives its rows as lists); ValueError for prompts
    that are not a list of sequences, naming the request."""
    rows = prompts.tolist() if hasattr(prompts, "tolist") else prompts
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    tokens = [row.tolist() if hasattr(row, "tolist") else row for row in rows]
    for index, (row, prompt) in enumerate(zip(tokens, rows)):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise ValueError(f"request {index}: a prompt must be a list of token ids, got {type(prompt).__name__}")
    return tokens


def _check_prompt(index: int, tokens: Sequence, vocab_size: int) -> list[int]:
    if len(tokens) == 0:
        raise ValueError(f"request {index}: empty prompt")
    ids = []
    for position, token in enumerate(tokens):
        value = token if type(token) is int else as_int(token)
        if value is None:
            raise ValueError(f"request {index}: token {token!r} at position {position} must be an int, "
                             f"got {type(token).__name__}")
        if not 0 <= value < vocab_size:
            raise ValueError(f"request {index}: token {value} at position {position} is not an id in "
                             f"[0, {vocab_size})")
        ids.append(value)
    return ids


def check_fits(requests: list[Request], text_config, block_size: int, capacity: int, limit: str) -> None:
    """ValueError for a request longer than the model's learned positions or than the whole cache (`capacity`
    blocks, set by `limit`); a warning past a rotary model's max_position_embeddings, as HF generate's. A request
    feeds len(prompt) + max_new_tokens - 1 positions: its last token is never fed back."""
    learned = learned_position_limit(text_config)
    rotary = None if learned is not None else getattr(text_config, "max_position_embeddings", None)
    for request in requests:
        prefix = (f"request {request.index}: prompt of {len(request.prompt)} tokens plus max_new_tokens="
                  f"{request.params.max_new_tokens}")
        if learned is not None and request.max_positions > learned:
            raise ValueError(f"{prefix} exceeds the model's {learned} learned positions")
        if rotary is not None and request.max_positions > rotary:
            warnings.warn(f"generating past the model's max_position_embeddings ({rotary}): positions beyond it were "
                          "not trained, the output may degrade", stacklevel=3)
            rotary = None
        needed = blocks_for(request.max_positions, block_size)
        if needed > capacity:
            raise ValueError(f"{prefix} needs {needed} KV blocks of {block_size} tokens, but the cache "
                             f"holds at most {capacity} ({limit})")


def learned_position_limit(text_config) -> int | None:
    """The hard length limit of models with a learned position table (GPT-2, OPT, ...); None for rotary models."""
    if any(getattr(text_config, name, None) is not None for name in ("rope_theta", "rope_parameters", "rope_scaling")):
        return None
    for name in ("max_position_embeddings", "n_positions"):
        if getattr(text_config, name, None):
            return getattr(text_config, name)
    return None
