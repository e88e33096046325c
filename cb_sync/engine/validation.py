"""generate()'s input checks: a model whose weights are all there, Requests from prompt rows and params, lengths
against the model and the cache; the warning a call may give, once nothing in it is refused."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch.nn.parameter import UninitializedTensorMixin

from ..config import SamplingParams, as_int, seed_int
from ..model_patching.swaps import module_list
from ..cache.sizing import blocks_for
from ..scheduler.request import Request


def check_materialized(model: torch.nn.Module) -> None:
    """ValueError naming the first parameter or buffer of `model` that holds no values: on the meta device (a model
    built under `torch.device("meta")`, or loaded with its weights still to come) or a lazy module's uninitialised
    parameter. Nothing could run on it: this says why before any work, where torch would fail deep in a step."""
    for module in module_list(model):
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None and (tensor.is_meta or isinstance(tensor, UninitializedTensorMixin)):
                kind, name = next((kind, name) for kind, named in (("parameter", model.named_parameters()),
                                                                    ("buffer", model.named_buffers()))
                                  for name, t in named if t is tensor)
                raise ValueError(f"the model's {kind} {name!r} holds no values (device {tensor.device}, "
                                 f"{type(tensor).__name__}): load or materialise its weights before generating")


def build_requests(rows: list[Sequence], params, seed: int | None, vocab_size: int,
                   generation_config) -> list[Request]:
    """One Request per prompt row (`prompts.prompt_rows`); a request without a seed of its own draws one from `seed`
    (None: torch's global RNG, drawn from only once every check has passed). Errors are ValueErrors naming the
    request and the bad value."""
    params = SamplingParams() if params is None else params
    if isinstance(params, SamplingParams):
        params = [params] * len(rows)
    elif isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
        raise ValueError(f"params must be a SamplingParams or a list of one per prompt, got {type(params).__name__}")
    elif len(params) != len(rows):
        raise ValueError(f"got {len(params)} SamplingParams for {len(rows)} prompts")
    seed = seed_int(seed)
    default_eos = generation_config.eos_token_id if generation_config is not None else None
    eos_ids = {}                                      # id(params) -> its EOS ids, once it has been checked
    for index, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"request {index}: params must be SamplingParams, got {type(p).__name__}")
        if id(p) not in eos_ids:                      # again: a dataclass may have been changed since it was built
            try:
                p.__post_init__()
            except ValueError as error:
                raise ValueError(f"request {index}: {error}") from None
            eos = p.eos_token_id if p.eos_token_id is not None else default_eos
            eos_ids[id(p)] = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
            _check_masks(index, p, eos_ids[id(p)], vocab_size)
    prompts = [_check_prompt(index, prompt, vocab_size) for index, prompt in enumerate(rows)]
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    seeds = iter(torch.randint(0, 2**62, (sum(p.seed is None for p in params),), generator=generator).tolist())
    return [Request(index, tokens, p, p.seed if p.seed is not None else next(seeds), eos_ids[id(p)])
            for index, (tokens, p) in enumerate(zip(prompts, params))]


def _check_masks(index: int, params: SamplingParams, eos_ids: frozenset[int], vocab_size: int) -> None:
    """ValueError for suppress_tokens outside the vocabulary, or that leave no token to choose: alone, or with the
    EOS and stop ids that min_new_tokens masks at the first positions (a sampler would return a masked token)."""
    outside = [t for t in params.suppress_tokens if t >= vocab_size]
    if outside:
        raise ValueError(f"request {index}: suppress_tokens {outside} are not ids in [0, {vocab_size})")
    banned = set(params.suppress_tokens)
    what = "suppress_tokens"
    if params.min_new_tokens and len(banned) < vocab_size:
        banned |= {t for t in eos_ids | set(params.stop_token_ids) if 0 <= t < vocab_size}
        what = f"suppress_tokens, with the EOS and stop ids min_new_tokens={params.min_new_tokens} masks,"
    if len(banned) >= vocab_size:
        raise ValueError(f"request {index}: {what} cover all {vocab_size} token ids: no token is left to choose")


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
    blocks, set by `limit`). A request feeds len(prompt) + max_new_tokens - 1 positions: its last token is never fed
    back."""
    learned = learned_position_limit(text_config)
    for request in requests:
        prefix = (f"request {request.index}: prompt of {len(request.prompt)} tokens plus max_new_tokens="
                  f"{request.params.max_new_tokens}")
        if learned is not None and request.max_positions > learned:
            raise ValueError(f"{prefix} exceeds the model's {learned} learned positions")
        needed = blocks_for(request.max_positions, block_size)
        if needed > capacity:
            raise ValueError(f"{prefix} needs {needed} KV blocks of {block_size} tokens, but the cache "
                             f"holds at most {capacity} ({limit})")


def warn_of_doubtful_input(requests: list[Request], text_config) -> None:
    """A warning, once a call, for positions past a rotary model's max_position_embeddings (as HF generate warns):
    input that runs but may not be what the caller meant. Given after every check has passed: a call that raises
    gives no warning first."""
    if learned_position_limit(text_config) is None:
        rotary = getattr(text_config, "max_position_embeddings", None)
        if rotary is not None and max(request.max_positions for request in requests) > rotary:
            warnings.warn(f"generating past the model's max_position_embeddings ({rotary}): positions beyond it were "
                          "not trained, the output may degrade", stacklevel=3)


def learned_position_limit(text_config) -> int | None:
    """The hard length limit of models with a learned position table (GPT-2, OPT, ...); None for rotary models."""
    if any(getattr(text_config, name, None) is not None for name in ("rope_theta", "rope_parameters", "rope_scaling")):
        return None
    for name in ("max_position_embeddings", "n_positions"):
        if getattr(text_config, name, None):
            return getattr(text_config, name)
    return None
