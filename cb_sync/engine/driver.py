"""SyncCBDriver: owns the KV cache, scheduler and runner, and runs the generate() loop on the caller's thread: plain
steps (schedule -> execute -> update) and, after a replayed pure-decode step, launch-ahead steps."""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from ..attention import StepBackends, sdpa_paged, select_backends
from ..batch_invariant import attention as invariant
from ..batch_invariant import check_model, invariant_ops
from ..batch_invariant.fused_forwards import fused_forwards
from ..batch_invariant.lora import invariant_tuning
from ..cache import BlockAllocator, PagedAttentionCache
from ..cache.sizing import (attention_heads, blocks_at_once, blocks_for, blocks_to_allocate, device_room,
                            step_headroom)
from ..config import CBConfig, SamplingParams
from ..graphs import CompiledForward, DecodeReplay, decode_buckets, eager_forward
from ..graphs.compiled import compiled_buckets
from ..lora import kernel_row_limit, lora_kernels
from ..model_patching.generation_mode import generation_mode
from ..model_patching.support import check_supported
from ..model_patching.swaps import base_model
from ..runner import ModelRunner, StepOutput
from ..scheduler import FIFOScheduler, GenerationResult, Request, Status
from ..tuning import LoraTuning
from .call_lock import one_call_at_a_time
from .prompts import pad_ids, prompt_rows
from .validation import build_requests, check_fits, check_materialized, warn_of_doubtful_input

logger = logging.getLogger(__name__)


class SyncCBDriver:
    """Generates from a Hugging Face causal LM (PEFT-wrapped or not) by synchronous continuous batching.

    The driver runs the very modules it is given: weight updates between calls are seen by the next call.
    KV memory is allocated for each call's needs and kept for the next one until release().

    Threads: the calls of every driver in a process (construction, generate(), release()) run one at a time (a second
    thread waits for the first call to return); a call from within a running one on the same thread (from the
    observer) raises RuntimeError. The model's attention implementation and its modules' training flags end every
    call as they began."""

    def __init__(self, model: torch.nn.Module, config: CBConfig | None = None, *, observer=None,
                 static_decode: bool | None = None):
        """Check the model and bind a cache and step executors to its device and dtype (the cache's memory is
        allocated by generate()).

        Args:
            model: a transformers causal LM, or a PEFT model wrapping one, whose attention goes through
                transformers' AttentionInterface, with every weight materialised.
            config: engine settings (None: `CBConfig()`).
            observer: called with every step's output (`runner.StepOutput`) as it is launched.
            static_decode: pure-decode steps replay captured graphs over static buffers (None: where CUDA graphs
                apply; True also off CUDA, where a "graph" runs its step uncaptured, as the CPU tests of that path
                do).

        Raises:
            ValueError: a parameter or buffer holds no values (the meta device), a model cb_sync cannot drive
                (`model_patching.support.check_supported`: not a transformers model, an encoder-decoder, layers
                that are not attention, attention it cannot replace or reach), or (with `batch_invariant`) layers
                the exact mode does not cover.
        """
        self.model = model
        self.config = config or CBConfig()
        self.observer = observer
        self.static_decode = static_decode
        with one_call_at_a_time("__init__()"):     # check_supported switches the model's attention and back
            check_materialized(model)
            check_supported(model)
            if self.config.batch_invariant:
                check_model(model)
            self._bind()
        if self.config.compile and self.runner.replay is None:
            warnings.warn(f"CBConfig(compile=True) is ignored on {self.device.type} with attn_backend="
                          f"{self.config.attn_backend!r}, cuda_graphs={self.config.cuda_graphs}: compile applies only "
                          "where CUDA graphs run (CUDA, triton or flash backend)", stacklevel=2)

    def _bind(self) -> None:
        """Size the cache, backend and step executors for the model's current device and dtype."""
        base = base_model(self.model)
        text_config = base.config.get_text_config()
        embeddings = base.get_input_embeddings().weight
        self.device, self.dtype = embeddings.device, embeddings.dtype
        _, num_kv_heads, head_dim = attention_heads(text_config)
        self.cache = PagedAttentionCache(text_config.num_hidden_layers, num_kv_heads, head_dim, self.config.block_size,
                                  self.dtype, self.device)
        self.backends = StepBackends(invariant, invariant) if self.config.batch_invariant else select_backends(
            self.config.attn_backend, self.device, self.dtype)
        self.runner = self._runner()

    def _runner(self) -> ModelRunner:
        """Replayed graphs for pure decode where they apply, the forward compiled where asked (inside the graphs)."""
        cfg, tuning = self.config, self.config.tuning.attention
        replay = compiled = None
        static = self.static_decode if self.static_decode is not None else (
            self.device.type == "cuda" and self.backends.decode is not sdpa_paged)
        if cfg.cuda_graphs and static:
            forward = CompiledForward(self.model, kernel_row_limit(self.model)) if cfg.compile else None
            buckets, compiled = compiled_buckets(forward, decode_buckets(cfg.max_batch_size))
            replay = DecodeReplay(forward or eager_forward(self.model), self.cache, self.backends.decode, tuning,
                                  buckets)
        return ModelRunner(self.model, self.cache, self.backends, tuning, replay, compiled, self.observer)

    def _follow_model(self) -> None:
        """Re-bind after the model moved to another device or dtype (`.to()`), dropping the old cache."""
        weight = base_model(self.model).get_input_embeddings().weight
        if (weight.device, weight.dtype) != (self.device, self.dtype):
            self._release(keep_graphs=False)
            self._bind()

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 seed: int | None = None, *, attention_mask=None,
                 progress_bar: bool | None = None) -> list[GenerationResult]:
        """Generate a continuation for every prompt; results come back in input order. Bad input raises ValueError
        before any work, and before any warning.

        Args:
            prompts: lists of token ids (ints, numpy or torch integers), unpadded; a 2-D tensor or array (refused
                where its rows start or end with the model's pad token, or EOS where it names no pad token, unless
                attention_mask comes with it); or a tokenizer's encoding (a BatchEncoding or dict with `input_ids`
                and, where padded, `attention_mask`).
            params: one SamplingParams for all prompts, or one per prompt (None: `SamplingParams()`).
            seed: each request without a seed of its own derives a distinct one from it: the call is reproducible
                and the G copies of a GRPO prompt differ. None draws them from torch's global RNG.
            attention_mask: 0/1 rows beside padded prompts (left or right padding): each prompt is cut to the
                tokens its row keeps.
            progress_bar: show a progress bar of the tokens generated (None: `CBConfig.progress_bar`).

        Returns:
            One GenerationResult per prompt, in input order; its `prompt_ids` are the unpadded prompt.

        Raises:
            ValueError: a bad prompt, mask or parameter (naming the request), a request that cannot fit the model's
                positions or the cache, a weight of the model that holds no values.
            RuntimeError: a driver call is running on this thread already.
        """
        if progress_bar is not None and not isinstance(progress_bar, bool):
            raise ValueError(f"progress_bar must be True, False or None, got {progress_bar!r}")
        base = base_model(self.model)
        with one_call_at_a_time("generate()"):
            check_materialized(self.model)
            vocab_size = base.get_output_embeddings().weight.shape[0]       # read at every call: embeddings resize
            rows = prompt_rows(prompts, attention_mask, pad_ids(base))
            requests = build_requests(rows, params, seed, vocab_size, base.generation_config)
            if not requests:
                return []
            self._follow_model()
            text_config = base.config.get_text_config()
            capacity, limit = self._capacity_blocks(text_config)
            check_fits(requests, text_config, self.config.block_size, capacity, limit)
            warn_of_doubtful_input(requests, text_config)
            self._generate(requests, capacity, progress_bar)
            self._note_preemptions(requests, limit)
            return [GenerationResult.of(r) for r in requests]

    def _generate(self, requests: list[Request], capacity: int, progress_bar: bool | None) -> None:
        """Run checked requests to their end, the model in generation mode, the cache sized to them."""
        cfg = self.config
        num_blocks = cfg.num_blocks or blocks_to_allocate([r.max_positions for r in requests], cfg.block_size,
                                                          cfg.max_batch_size, capacity)
        show = cfg.progress_bar if progress_bar is None else progress_bar
        lora_tuning = self._lora_tuning()
        with contextlib.ExitStack() as call:
            modules = call.enter_context(generation_mode(self.model))
            call.enter_context(lora_kernels(self.model, lora_tuning is not None, modules,
                                            lora_tuning or cfg.tuning.lora))
            if cfg.batch_invariant:
                call.enter_context(fused_forwards(modules))
                call.enter_context(invariant_ops())
            bar = call.enter_context(tqdm(total=sum(r.params.max_new_tokens for r in requests), unit="tok",
                                          desc="cb_sync", disable=not (sys.stderr.isatty() if show is None else show)))
            self.cache.ensure(num_blocks)
            self.runner.begin_call(requests, max(blocks_for(r.max_positions, cfg.block_size) for r in requests),
                                   modules)
            self._run(requests, bar)

    def _note_preemptions(self, requests: list[Request], limit: str) -> None:
        """A warning on the log where the cache was too small for the call: what it needed, what it held, why."""
        preemptions = sum(r.num_preemptions for r in requests)
        if not preemptions:
            return
        gib = self.cache.bytes_per_block / 2**30
        needed = blocks_at_once([r.max_positions for r in requests], self.config.block_size,
                                self.config.max_batch_size) * gib
        logger.warning("%d preemptions: the call's %d requests need up to %.3g GiB of KV cache at once, the cache "
                       "held %.3g GiB (%s). A preempted request is recomputed from its prompt and the tokens it had "
                       "sampled (none lost, time lost): give the cache more memory where it can have it.",
                       preemptions, len(requests), needed, self.cache.num_blocks * gib, limit)

    def _lora_tuning(self) -> LoraTuning | None:
        """The LoRA kernels' tuning for this call, None where PEFT's own forward runs."""
        cfg = self.config
        if cfg.batch_invariant:
            return invariant_tuning(cfg.lora_kernels, cfg.tuning.lora, self.device)
        return cfg.tuning.lora if cfg.lora_kernels and self.backends.decode is not sdpa_paged else None

    def release(self, keep_graphs: bool = False) -> None:
        """Free the KV cache for training, and the captured graphs unless keep_graphs; the next generate() allocates
        the cache again. Waits for a driver call running on another thread.

        Args:
            keep_graphs: keep the captured decode graphs (their memory: one decode step's activations per bucket, in
                one pool). They are replayed again over the new cache: the Triton backend's decode reaches the pools
                through a table of where they lie (`PagedAttentionCache.pool_offsets`), wherever they land; other backends'
                graphs only where the pools come back at the same addresses, else they are captured again. Kept
                graphs keep the token ids that penalties read (8 bytes a cache slot, `sampling.penalties.TokenHistory`).

        Raises:
            RuntimeError: a driver call is running on this thread already.
        """
        with one_call_at_a_time("release()"):
            self._release(keep_graphs)

    def _release(self, keep_graphs: bool) -> None:
        self.cache.release()
        self.runner.release(keep_graphs)

    def _run(self, requests: list[Request], bar: tqdm) -> None:
        """Steps until every request has finished: a plain step, or a launch-ahead step where the step before was
        replayed and its tokens are not read yet."""
        cfg = self.config
        scheduler = FIFOScheduler(BlockAllocator(self.cache.num_blocks), cfg.block_size, cfg.max_batch_tokens,
                              cfg.max_batch_size, cfg.prefix_sharing)
        for request in requests:
            scheduler.add(request)
        unread = None                                   # a replayed step, its tokens not read yet
        while unread is not None or scheduler.has_work():
            if unread is None:
                unread = self._plain_step(scheduler, bar)
            else:
                unread = self._launch_ahead_step(scheduler, unread, bar)

    def _plain_step(self, scheduler: FIFOScheduler, bar: tqdm) -> StepOutput | None:
        """schedule -> execute -> update. A replayed step's tokens are left unread, and the step returned: the next
        step may be launched before they are read (`_launch_ahead_step`)."""
        plan = scheduler.schedule()
        if not plan:
            raise RuntimeError("the scheduler could not place any request in the cache")
        output = self.runner.execute(plan)
        if output.keeps_tokens_on_device:
            return output
        self._update(scheduler, output, bar)
        return None

    def _launch_ahead_step(self, scheduler: FIFOScheduler, unread: StepOutput, bar: tqdm) -> StepOutput | None:
        """Launch the pure-decode step that continues `unread` (its requests one position on), which takes unread's
        tokens on the device, and only then read them: the host's work overlaps the GPU's. A request that ends on a
        stop or EOS token then has had one more row computed, which is dropped. Returns the step launched, its tokens
        unread (None where no step continues `unread`: a plain step follows)."""
        following = scheduler.plan_ahead(unread.plan)
        launched = self.runner.execute(following, after=unread) if following else None
        self._update(scheduler, unread, bar)
        return launched

    @staticmethod
    def _update(scheduler: FIFOScheduler, output: StepOutput, bar: tqdm) -> None:
        """Read a step's tokens into its requests and the scheduler; count progress."""
        sampled, tokens, logprobs = output.result()
        live = sum(request.status is not Status.FINISHED for request in sampled)
        for request in scheduler.update(output.plan, sampled, tokens, logprobs):
            bar.update(request.params.max_new_tokens - len(request.output))
        bar.update(live)

    def _capacity_blocks(self, text_config) -> tuple[int, str]:
        """The most KV blocks this call may allocate, and what sets that limit: CBConfig's num_blocks or
        max_cache_gib, or on a GPU with less free memory than the cap, that memory less what a step needs
        (`device_room`, `step_headroom`): the call then preempts instead of running out of memory."""
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks, f"CBConfig num_blocks={cfg.num_blocks}"
        cap = int(cfg.max_cache_gib * 2**30)
        headroom = step_headroom(text_config, cfg.max_batch_tokens, cfg.max_batch_size, self.dtype.itemsize)
        room = device_room(self.device, self.cache.nbytes, headroom)
        if room is not None and room < cap:     # the pools held now serve the call whatever is free
            return max(room // self.cache.bytes_per_block, self.cache.num_blocks), (
                f"the GPU's free memory, {room / 2**30:.3g} GiB for the cache after {headroom / 2**30:.3g} GiB kept "
                f"for a step, below CBConfig max_cache_gib={cfg.max_cache_gib:g}")
        return cap // self.cache.bytes_per_block, f"CBConfig max_cache_gib={cfg.max_cache_gib:g}"
