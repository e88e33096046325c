"""transformers drop-in: `enable(model)` makes `model.generate_batch` run on a persistent cb_sync driver, with
transformers 5.17's signature and return type (a dict `req_0, req_1, ...` of `GenerationOutput`, in input order),
so code written for transformers' continuous batching, such as TRL's `use_transformers_continuous_batching=True`
path, runs on cb_sync unchanged.

A `GenerationConfig` is read as `model.generate()` reads it: fields left `None` come from `model.generation_config`,
then from transformers' defaults (top-k 50 when sampling with `top_k` unset; 20 tokens minus the prompt without
`max_new_tokens` or `max_length`). Honoured: `max_new_tokens` (else `max_length`), `do_sample`, `temperature`,
`top_k`, `top_p`, `min_p`, `repetition_penalty`, `min_new_tokens` and `min_length` (EOS masked until both are
reached), `suppress_tokens`, `eos_token_id` (None, [] or -1: no EOS; negative ids in a list are dropped),
`pad_token_id`. Other fields that would change the tokens (beams, no_repeat_ngram_size, bad_words_ids, several return
sequences, ...) raise ValueError naming them; fields that cannot (output flags, cache and compile settings, beam-only
settings while num_beams == 1, ...) are ignored.

Logprobs (`return_logprobs=True`) are cb_sync's: log_softmax(logits / temperature) of the model's logits over the whole
vocabulary, before penalties and filters (what a trainer recomputes from the same model). transformers' own engine
returns the log of the processed distribution, after penalties and the top-k / top-p / min-p filters, which is
larger under a filter (it renormalises over the tokens kept); one semantics is kept here, the trainer's.

Of `ContinuousBatchingConfig` only `return_logprobs` and `seed` (one seed per call) are used: size cb_sync with the
`CBConfig` given to `enable`. `persistent_manager=False` (the default) releases the KV cache after the call and keeps
the captured decode graphs (`disable` frees both). Errors are raised, not logged."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
import types

import torch
from transformers import GenerationConfig

# transformers' own output type, so consumers of generate_batch work unchanged
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from ..config import CBConfig, SamplingParams, as_int
from ..engine.driver import SyncCBDriver
from ..engine.prompts import pad_ids, prompt_rows
from ..model_patching.swaps import base_model

logger = logging.getLogger(__name__)

__all__ = ["enable", "disable", "is_enabled", "get_driver", "sampling_params_from_generation_config"]

_STATE = "_cb_sync_state"
_METHOD = "generate_batch"

# GenerationConfig fields mapped onto SamplingParams.
_MAPPED = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "min_p", "eos_token_id",
           "pad_token_id", "repetition_penalty", "min_new_tokens", "min_length", "suppress_tokens"}
# vLLM's penalty options, set on a GenerationConfig as extra attributes (TRL's generation_kwargs): mapped only where
# the caller asks (`vllm_options=True`), as HF's generate() ignores them.
_VLLM = {"presence_penalty", "frequency_penalty", "min_tokens"}
# Fields that cannot change the generated tokens of a single-sequence decoder-only generation.
_HARMLESS = {"bos_token_id", "decoder_start_token_id", "use_cache", "cache_implementation", "cache_config",
             "max_cache_len", "compile_config", "disable_compile", "continuous_batching_config", "prefill_chunk_size",
             "low_memory", "return_dict_in_generate", "output_attentions", "output_hidden_states", "output_scores",
             "output_logits", "remove_invalid_values", "renormalize_logits", "transformers_version",
             "_from_model_config", "_commit_hash", "_original_object_hash", "is_assistant", "num_assistant_tokens",
             "num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_lookbehind",
             "target_lookbehind", "max_matching_ngram_size",
             # beam-search-only settings: inert while num_beams == 1 (num_beams > 1 is refused)
             "early_stopping", "length_penalty", "num_beam_groups", "diversity_penalty"}
# Values of the remaining fields that leave the tokens unchanged (None is always neutral).
_NEUTRAL = {"num_beams": 1, "num_return_sequences": 1, "encoder_repetition_penalty": 1.0, "typical_p": 1.0,
            "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0,
            "guidance_scale": 1.0, "penalty_alpha": 0.0, "top_h": None}
# transformers' global defaults for the mapped fields (GenerationConfig._get_default_generation_params, 5.17).
_DEFAULTS = {"max_length": 20, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
# ContinuousBatchingConfig fields used here; the others only size or tune transformers' own engine.
_CB_USED = {"return_logprobs", "seed"}
_noted: set[str] = set()    # the sets of ignored ContinuousBatchingConfig fields logged so far


class _State:
    """What enable() leaves on a model: the engine config, the lazily built driver, and what it replaced."""

    def __init__(self, model, config: CBConfig, targets: list):
        self.model = model              # the module the driver runs (None: the module the method is bound to)
        self.config = config
        self.driver: SyncCBDriver | None = None
        self.targets = targets          # modules carrying the installed method
        self.previous = {id(t): t.__dict__.get(_METHOD) for t in targets}  # instance attributes it shadows

    def driver_for(self, bound) -> SyncCBDriver:
        if self.driver is None:         # the driver follows later moves and casts of the model itself
            self.driver = SyncCBDriver(self.model if self.model is not None else bound, self.config)
        return self.driver

    def __deepcopy__(self, memo):
        # A copied model generates with its own modules: keep the config, drop driver and model references.
        return _State(None, self.config, [])

    def __getstate__(self):
        return self.__deepcopy__({}).__dict__


def enable(model: torch.nn.Module, config: CBConfig | None = None) -> torch.nn.Module:
    """Install `model.generate_batch` (transformers 5.17 signature) backed by one cb_sync driver kept on the model.

    On a PEFT model the method is installed both on the PeftModel and on its base model (what TRL reaches through
    `unwrap_model`), sharing one driver that runs the PeftModel. A plain model that is later wrapped by PEFT keeps
    working: the wrapper forwards `generate_batch` to the base model, whose modules carry the LoRA layers.
    Calling enable() again replaces the config (and the driver).

    Args:
        model: a transformers causal LM, or a PEFT model of one.
        config: the driver's engine settings (CBConfig()); the driver is built at the first call.

    Returns:
        The same model.
    """
    config = config if config is not None else CBConfig()
    if not isinstance(config, CBConfig):
        raise ValueError(f"config must be a CBConfig, got {type(config).__name__}")
    targets = [model]
    if hasattr(model, "get_base_model") and model.get_base_model() is not model:
        targets.append(model.get_base_model())
    for target in targets:      # also a base model enabled before PEFT wrapped it: its driver and method go
        disable(target)
    state = _State(model, config, targets)
    for target in targets:
        object.__setattr__(target, _STATE, state)
        object.__setattr__(target, _METHOD, types.MethodType(_generate_batch, target))
    return model


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Remove what enable() installed, free the driver's KV cache and graphs, and restore what was there before.

    Args:
        model: a model passed to enable() (or its base model); any other is left as it is.

    Returns:
        The same model.
    """
    state = model.__dict__.get(_STATE)
    if state is None:
        return model
    if state.driver is not None:
        state.driver.release()
    for target in state.targets or [model]:
        target.__dict__.pop(_STATE, None)
        target.__dict__.pop(_METHOD, None)
        previous = state.previous.get(id(target))
        if previous is not None:
            object.__setattr__(target, _METHOD, previous)
    return model


def is_enabled(model: torch.nn.Module) -> bool:
    """Whether enable() has routed this model's generate_batch to cb_sync (and disable() has not undone it).

    Args:
        model: any module.

    Returns:
        True where `model.generate_batch` runs on cb_sync.
    """
    return _STATE in model.__dict__


def get_driver(model: torch.nn.Module) -> SyncCBDriver:
    """The driver behind an enabled model's generate_batch (built now if no call has built it yet).

    Args:
        model: a model passed to enable().

    Returns:
        Its SyncCBDriver.

    Raises:
        ValueError: cb_sync is not enabled on the model.
    """
    state = model.__dict__.get(_STATE)
    if state is None:
        raise ValueError("cb_sync is not enabled on this model: call cb_sync.integrations.transformers.enable(model)")
    return state.driver_for(model)


def _generate_batch(self, inputs: list[list[int]], generation_config=None, continuous_batching_config=None,
                    record_timestamps: bool = False, progress_bar: bool = False, persistent_manager: bool = False,
                    warmup: bool = True, *, attention_mask=None, **kwargs) -> dict:
    """Generate for a batch of prompts with cb_sync (drop-in for transformers' `generate_batch`).

    Args:
        inputs: the prompts' token ids, in any form `SyncCBDriver.generate` takes: lists, a 2-D tensor or array, a
            tokenizer's encoding (padded rows are cut to their unmasked tokens).
        generation_config: read as `model.generate()` reads it (see the module's docstring).
        continuous_batching_config: only its `return_logprobs` and `seed` are used.
        record_timestamps: must be False (cb_sync records no per-token timestamps).
        progress_bar: show the driver's progress bar.
        persistent_manager: keep the KV cache after the call (False: released, the decode graphs kept).
        warmup: accepted and ignored (graphs are captured on first use).
        attention_mask: 0/1 rows beside padded `inputs` (left or right padding).
        **kwargs: GenerationConfig field names (override `generation_config`), `return_logprobs` (bool) and `seed`
            (int: one seed for the call, each request derives its own). Anything else raises ValueError.

    Returns:
        {"req_i": GenerationOutput} in input order, each with cb_sync's `finish_reason` ("eos", "length", "stop").
    """
    driver = self.__dict__[_STATE].driver_for(self)     # built once, refusing a model cb_sync cannot drive
    model = driver.model
    prompts = prompt_rows(inputs, attention_mask, pad_ids(base_model(model)))
    if not prompts:
        return {}
    if record_timestamps:
        raise ValueError("cb_sync's generate_batch does not record per-token timestamps (record_timestamps=True)")
    return_logprobs = kwargs.pop("return_logprobs", False)
    seed = kwargs.pop("seed", None)
    if continuous_batching_config is not None:
        return_logprobs = return_logprobs or getattr(continuous_batching_config, "return_logprobs", False)
        seed = getattr(continuous_batching_config, "seed", None) if seed is None else seed
        _note_ignored_cb_fields(continuous_batching_config)
    if not isinstance(return_logprobs, bool):
        raise ValueError(f"return_logprobs must be True or False, got {return_logprobs!r}")
    params = sampling_params_from_generation_config(model, generation_config, prompts, logprobs=return_logprobs,
                                                    **kwargs)
    start = time.perf_counter()
    try:
        results = driver.generate(prompts, params, progress_bar=progress_bar, seed=seed)
    finally:
        if not persistent_manager:
            driver.release(keep_graphs=True)
    end = time.perf_counter()
    outputs = {}
    for result in results:
        out = GenerationOutput(request_id=f"req_{result.request_id}", prompt_ids=list(result.prompt_ids),
                               generated_tokens=list(result.token_ids), logprobs=list(result.logprobs or []),
                               error=None, status=RequestStatus.FINISHED, created_time=start, lifespan=(start, end))
        out.finish_reason = result.finish_reason  # cb_sync extra: "eos" | "length" | "stop"
        outputs[out.request_id] = out
    return outputs


def sampling_params_from_generation_config(model, generation_config=None, prompts: list[list[int]] | None = None,
                                           logprobs: bool = False, vllm_options: bool = False,
                                           **overrides) -> list[SamplingParams]:
    """SamplingParams from a GenerationConfig resolved as `model.generate()` resolves it; ValueError for any field
    that would change the result and that cb_sync cannot honour. Seeds are left unset (`SyncCBDriver.generate(seed=)`
    derives one per request).

    Args:
        model: the model whose `generation_config` fills the fields left None.
        generation_config: a transformers GenerationConfig (None: an empty one).
        prompts: the prompts' token ids, which `max_length` and `min_length` count (None: one empty prompt).
        logprobs: whether the completions carry their tokens' logprobs.
        vllm_options: also honour vLLM's `presence_penalty`, `frequency_penalty` and `min_tokens` set on the config
            (TRL's generation_kwargs for its vLLM path); else they are refused, as any field cb_sync does not map.
        **overrides: GenerationConfig fields set last, as generate()'s keyword arguments.

    Returns:
        One SamplingParams per prompt.
    """
    prompts = prompts if prompts is not None else [[]]
    cfg = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    if not isinstance(cfg, GenerationConfig):
        raise ValueError(f"generation_config must be a transformers GenerationConfig, got {type(cfg).__name__}")
    fields = set(GenerationConfig().to_dict())
    unknown = sorted(k for k in overrides if k not in fields)
    if unknown:
        raise ValueError(f"generate_batch got unexpected keyword arguments {unknown}")
    values = cfg.to_dict()
    model_cfg = getattr(model, "generation_config", None)
    if model_cfg is not None:  # like generate(): unset fields come from the model's generation config
        for name, value in model_cfg.to_dict().items():
            if name in fields and values.get(name) is None:  # custom entries of a checkpoint's config are inert
                values[name] = value
    values.update({name: value for name, value in _DEFAULTS.items() if values.get(name) is None})
    values.update(overrides)   # like generate()'s keyword arguments: last, a None among them included
    mapped = _MAPPED | _VLLM if vllm_options else _MAPPED
    bad = sorted(f"{k}={v!r}" for k, v in values.items()
                 if k not in mapped and k not in _HARMLESS and not _is_neutral(k, v))
    if bad:
        raise ValueError(f"cb_sync cannot honour these generation options: {', '.join(bad)}. Remove them (or set "
                         "them to their neutral values) from the GenerationConfig and model.generation_config.")
    eos = _eos_ids(values.get("eos_token_id"))      # model.generation_config merged in, as generate() does
    sampling = {}
    if values["do_sample"]:     # a filter set to None by a keyword argument is off, as in generate()
        sampling = dict(do_sample=True, temperature=float(_or(values["temperature"], 1.0)),
                        top_k=int(_or(values["top_k"], 0)), top_p=float(_or(values["top_p"], 1.0)),
                        min_p=float(_or(values.get("min_p"), 0.0)))
    sampling.update(repetition_penalty=float(_or(values.get("repetition_penalty"), 1.0)),
                    suppress_tokens=list(_or(values.get("suppress_tokens"), [])))
    if vllm_options:
        sampling.update(presence_penalty=float(_or(values.get("presence_penalty"), 0.0)),
                        frequency_penalty=float(_or(values.get("frequency_penalty"), 0.0)))
    params = []
    for index, prompt in enumerate(prompts):
        max_new = values.get("max_new_tokens")
        if max_new is None and values["max_length"] is None:
            raise ValueError("max_new_tokens and max_length are both None: set max_new_tokens")
        if max_new is None:
            max_new = values["max_length"] - len(prompt)
            if max_new <= 0:
                raise ValueError(f"prompt {index} has {len(prompt)} tokens, not below max_length="
                                 f"{values['max_length']}: set max_new_tokens")
        # generate() masks EOS until min_new_tokens new tokens and min_length tokens in all; past max_new_tokens the
        # mask changes nothing
        min_new = max(_or(values.get("min_new_tokens"), 0), _or(values.get("min_length"), 0) - len(prompt),
                      _or(values.get("min_tokens"), 0) if vllm_options else 0)
        params.append(SamplingParams(max_new_tokens=int(max_new), eos_token_id=eos, logprobs=logprobs,
                                     min_new_tokens=min(int(min_new), int(max_new)), **sampling))
    return params


def _eos_ids(eos):
    """The EOS ids of a resolved config, for SamplingParams to validate: None, [] and negative ids mean no EOS, as
    transformers' continuous batching reads them (its generate_batch writes -1 into a GenerationConfig without one);
    negative ids in a list are dropped."""
    if eos is None:
        return []
    if isinstance(eos, (list, tuple)):
        return [token for token in eos if not _is_negative_id(token)]
    return [] if _is_negative_id(eos) else eos


def _is_negative_id(value) -> bool:
    number = as_int(value)
    return number is not None and number < 0


def _or(value, neutral):
    return neutral if value is None else value


def _is_neutral(name: str, value) -> bool:
    empty = value is None or (isinstance(value, (list, tuple, dict)) and len(value) == 0)
    return empty or (name in _NEUTRAL and value == _NEUTRAL[name])


def _note_ignored_cb_fields(cb_config) -> None:
    """Log the ContinuousBatchingConfig fields set off their defaults, which are ignored here (once per set)."""
    if not dataclasses.is_dataclass(cb_config):
        return
    default = type(cb_config)()
    ignored = [f.name for f in dataclasses.fields(cb_config) if f.name not in _CB_USED
               and getattr(cb_config, f.name) != getattr(default, f.name)]
    if ignored and ",".join(ignored) not in _noted:
        _noted.add(",".join(ignored))
        logger.info("cb_sync ignores these ContinuousBatchingConfig settings (size cb_sync with the CBConfig given "
                    "to enable()): %s", ", ".join(ignored))
