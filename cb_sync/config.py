"""User-facing configuration: CBConfig (engine) and SamplingParams (per request), validated on construction."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .tuning import KernelTuning

ATTN_BACKENDS = ("auto", "sdpa_paged", "triton", "flash", "flash_prefill")
MIN_TEMPERATURE = 1e-6        # logits / temperature stay finite in float32


@dataclass(frozen=True)
class CBConfig:
    """Engine settings for SyncCBDriver, validated once and frozen (`dataclasses.replace` makes a changed copy).

    Args (defaults in brackets):
        block_size [16]: tokens per KV block.
        num_blocks [None]: KV blocks to allocate; None sizes the cache to each call's needs, within max_cache_gib.
        max_batch_tokens [2048]: token budget of one step, shared by prefill chunks and decodes.
        max_batch_size [64]: most requests running at once.
        attn_backend ['auto']: "auto" (Triton on CUDA, else sdpa_paged) | "sdpa_paged" | "triton" | "flash"
            (flash-attn 4's paged kernels, an optional extra: ValueError naming what is missing where they cannot
            run) | "flash_prefill" (flash-attn 4 for steps with prompt tokens, which include the recompute of
            preempted requests; Triton for pure decode: for long prompts, about 1k tokens and more).
        cuda_graphs [True]: replay captured graphs for pure-decode steps (CUDA with the Triton or flash backend; the
            sdpa_paged reference syncs with the host and always runs eagerly).
        compile [False]: torch.compile the decode step before capture (CUDA graphs only; elsewhere ignored with a
            warning); prefill and mixed steps run the same compiled function, uncaptured.
        lora_kernels [True]: with the Triton or flash backend, PEFT LoRA Linear layers run cb_sync's Triton LoRA
            kernel in decode steps, compiled steps and long eager prefill steps (same parameters, PEFT's function);
            False keeps PEFT's own forward.
        max_cache_gib [16.0]: cap on KV memory when num_blocks is None; a call needing more preempts requests
            (recomputed later from their prompts and the tokens they had sampled) instead of failing, and logs a
            warning saying so. On a GPU with less free memory than the cap, the cache takes what is free, less what
            the largest step needs (an estimate from the model's widths, max_batch_tokens and max_batch_size; at
            least 2 GiB).
        prefix_sharing [True]: requests with identical prompt prefixes share their full KV blocks.
        progress_bar [None]: show a progress bar; None = only when stderr is a terminal.
        tuning [KernelTuning()]: tile sizes and size thresholds of the Triton kernels (`tuning.KernelTuning`).
        batch_invariant [False]: a request's tokens and logprobs depend on that request alone, bit for bit: not on
            what else is in the batch, on prefill chunking, preemption or graph replay (`cb_sync.batch_invariant`).
            LoRA layers run the LoRA kernel in one fixed tiling (on CUDA, with lora_kernels), means one program per
            row, other linear layers and reductions over fixed-shape row blocks, attention a row-invariant path;
            uncompiled; slower.

    Raises:
        ValueError: a field of the wrong type or out of range, naming it and the value.
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_batch_tokens: int = 2048
    max_batch_size: int = 64
    attn_backend: str = "auto"
    cuda_graphs: bool = True
    compile: bool = False
    lora_kernels: bool = True
    max_cache_gib: float = 16.0
    prefix_sharing: bool = True
    progress_bar: bool | None = None
    tuning: KernelTuning = field(default_factory=KernelTuning)
    batch_invariant: bool = False

    def __post_init__(self):
        counts = ["block_size", "max_batch_tokens", "max_batch_size"]
        for name in counts + ([] if self.num_blocks is None else ["num_blocks"]):
            object.__setattr__(self, name, _positive(name, getattr(self, name)))     # numpy ints to ints
        for name in ("cuda_graphs", "compile", "lora_kernels", "prefix_sharing", "batch_invariant"):
            _flag(name, getattr(self, name))
        if self.progress_bar is not None:
            _flag("progress_bar", self.progress_bar)
        if self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"attn_backend must be one of {ATTN_BACKENDS}, got {self.attn_backend!r}")
        if self.batch_invariant and (self.compile or self.attn_backend != "auto"):
            raise ValueError("batch_invariant=True runs its own attention, uncompiled: it needs compile=False and "
                             f"attn_backend='auto', got compile={self.compile}, attn_backend={self.attn_backend!r}")
        if not (_real(self.max_cache_gib) and math.isfinite(self.max_cache_gib) and self.max_cache_gib > 0):
            raise ValueError(f"max_cache_gib must be a finite number > 0, got {self.max_cache_gib!r}")


@dataclass
class SamplingParams:
    """How one request is decoded. Validated on construction, and again by generate() (a field may have changed
    since).

    Args (defaults in brackets):
        max_new_tokens [256]: most tokens to generate.
        do_sample [False]: sample; False is greedy decoding.
        temperature [1.0]: logits are divided by it (greedy decoding also accepts 0).
        top_k [0]: keep the k most likely tokens; 0 is off.
        top_p [1.0]: keep the most likely tokens whose probabilities sum to top_p.
        min_p [0.0]: drop tokens less likely than min_p times the most likely one.
        seed [None]: the request's sampling seed; None draws one per request, from generate(seed=...) where given,
            else from torch's global RNG.
        eos_token_id [None]: int, or list of ints (empty: no EOS); None takes the model's generation config at call
            time.
        stop_token_ids [[]]: extra tokens that end the request with finish_reason "stop".
        logprobs [False]: return log_softmax(logits / temperature) of each chosen token (raw log_softmax when greedy):
            of the model's logits over the whole vocabulary, before penalties, masks and filters (what a trainer
            recomputes from the same model; transformers' continuous batching renormalises after its filters).
        repetition_penalty [1.0]: HF's, over the prompt and the output: the logit l of a token seen so far becomes
            l / p where l > 0, else l * p; > 0, 1 is off.
        frequency_penalty [0.0], presence_penalty [0.0]: vLLM's (and OpenAI's), over the output only: a token's logit
            loses frequency_penalty times its count there, and presence_penalty if it is there at all; 0 is off.
        min_new_tokens [0]: the EOS and stop tokens cannot be chosen before this many tokens were generated, as
            vLLM's min_tokens (HF's min_new_tokens masks EOS only); 0 is off.
        suppress_tokens [[]]: token ids never chosen (generate() refuses masks that leave no token).

    temperature, top_k, top_p and min_p apply when do_sample. The logits are processed in HF generate's order:
    repetition penalty, then frequency and presence penalties (where vLLM applies them: before temperature), the masks
    of min_new_tokens and suppress_tokens, temperature, top-k, top-p, min-p; a draw or the argmax picks the token.

    Raises:
        ValueError: a field of the wrong type or out of range, naming it and the value.
    """

    max_new_tokens: int = 256
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    eos_token_id: int | list[int] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_new_tokens: int = 0
    suppress_tokens: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.max_new_tokens = _positive("max_new_tokens", self.max_new_tokens)
        _flag("do_sample", self.do_sample)
        _flag("logprobs", self.logprobs)
        greedy_zero = not self.do_sample and self.temperature == 0       # vLLM's way of asking for greedy
        if not (_real(self.temperature) and (MIN_TEMPERATURE <= self.temperature < math.inf or greedy_zero)):
            raise ValueError(f"temperature must be a number >= {MIN_TEMPERATURE} (do_sample=False for greedy), got "
                             f"{self.temperature!r}")
        top_k = as_int(self.top_k)
        if top_k is None or not 0 <= top_k < 2**63:
            raise ValueError(f"top_k must be an int in [0, 2**63) (0 = off), got {self.top_k!r}")
        if not (_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not (_real(self.min_p) and 0 <= self.min_p < 1):
            raise ValueError(f"min_p must be a number in [0, 1), got {self.min_p!r}")
        self.top_k, self.seed = top_k, seed_int(self.seed)
        if self.eos_token_id is not None:
            self.eos_token_id = _token_ids("eos_token_id", self.eos_token_id)
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids, allow_single=False)
        self._check_penalties()

    def _check_penalties(self) -> None:
        if not (_real(self.repetition_penalty) and 0 < self.repetition_penalty < math.inf):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got "
                             f"{self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not (_real(getattr(self, name)) and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name} must be a finite number (0 = off), got {getattr(self, name)!r}")
        min_new = as_int(self.min_new_tokens)
        if min_new is None or not 0 <= min_new <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be an int in [0, max_new_tokens={self.max_new_tokens}], got "
                             f"{self.min_new_tokens!r}")
        self.min_new_tokens = min_new
        self.repetition_penalty = float(self.repetition_penalty)
        self.frequency_penalty, self.presence_penalty = float(self.frequency_penalty), float(self.presence_penalty)
        self.suppress_tokens = _token_ids("suppress_tokens", self.suppress_tokens, allow_single=False)

    @property
    def filtered(self) -> bool:
        """Sampling with a top-k, top-p or min-p filter (needs the sorted sampler)."""
        return self.do_sample and bool(self.top_k or self.top_p < 1 or self.min_p > 0)


def _token_ids(name: str, ids, allow_single: bool = True):
    """Plain ints from an int or an iterable of ints (`as_int`'s ints); ValueError otherwise."""
    single = as_int(ids)
    if single is not None and not allow_single:
        raise ValueError(f"{name} must be a list of token ids, got {ids!r}")
    try:
        values = [single] if single is not None else [as_int(t) for t in ids]
    except TypeError:
        raise ValueError(f"{name} must be an int or a list of ints, got {ids!r}") from None
    if isinstance(ids, (str, bytes, Mapping)) or not all(t is not None and t >= 0 for t in values):
        raise ValueError(f"{name} must hold ints >= 0, got {ids!r}")
    return single if single is not None else values


def as_int(value) -> int | None:
    """An int from Python's or numpy's ints or a 0-d integer tensor, never from a bool; None for anything else."""
    if isinstance(value, torch.Tensor):
        integral = value.ndim == 0 and not (value.is_floating_point() or value.is_complex()
                                            or value.dtype == torch.bool)
        return int(value) if integral else None
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else None


def seed_int(seed) -> int | None:
    """A seed as an int in [0, 2**63), or None; ValueError otherwise."""
    value = as_int(seed)
    if seed is not None and (value is None or not 0 <= value < 2**63):
        raise ValueError(f"seed must be None or an int in [0, 2**63), got {seed!r}")
    return value


def _real(value) -> bool:
    """A real number (numpy's included), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive(name: str, value) -> int:
    number = as_int(value)
    if number is None or number <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return number


def _flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
