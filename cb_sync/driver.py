"""SyncCBDriver: owns the KV cache, scheduler and runner, and runs the generate() loop on the caller's thread."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from .attention import sdpa_paged, select_backend
from .cache import BlockAllocator, PagedKVCache, blocks_for, blocks_to_allocate
from .config import CBConfig, SamplingParams
from .graphs.decode_graphs import DecodeGraphs
from .lora import lora_kernels
from .model_state import base_model, check_supported, generation_mode
from .request import GenerationResult, Request, Status
from .runner import ModelRunner
from .scheduler import Scheduler
from .validation import build_requests, check_fits, learned_position_limit


class SyncCBDriver:
    """Generates from a Hugging Face causal LM (PEFT-wrapped or not) by synchronous continuous batching.

    The driver runs the very modules it is given: weight updates between calls are seen by the next call.
    KV memory is allocated for each call's needs and kept for the next one until release().
    """

    def __init__(self, model: torch.nn.Module, config: CBConfig | None = None):
        self.model = model
        self.config = config or CBConfig()
        check_supported(model)
        self._bind()
        if self.config.compile and self.graphs is None:
            warnings.warn(f"CBConfig(compile=True) is ignored on {self.device.type} with attn_backend="
                          f"{self.config.attn_backend!r}, cuda_graphs={self.config.cuda_graphs}: only the CUDA-graph "
                          "decode step (CUDA, triton backend) is compiled", stacklevel=2)

    def _bind(self) -> None:
        """Size the cache, backend and graphs for the model's current device and dtype."""
        base = base_model(self.model)
        text_config = base.config.get_text_config()
        embeddings = base.get_input_embeddings().weight
        self.device, self.dtype = embeddings.device, embeddings.dtype
        self.vocab_size = base.get_output_embeddings().weight.shape[0]
        self.max_positions = learned_position_limit(text_config)
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        num_kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        self.cache = PagedKVCache(text_config.num_hidden_layers, num_kv_heads, head_dim, self.config.block_size,
                                  self.dtype, self.device)
        self.backend = select_backend(self.config.attn_backend, self.device)
        self.graphs = None
        if self.config.cuda_graphs and self.device.type == "cuda" and self.backend is not sdpa_paged:
            self.graphs = DecodeGraphs(self.model, self.cache, self.backend, self.config.max_batch_size,
                                       self.config.compile)
        self.runner = ModelRunner(self.model, self.cache, self.backend, self.device, self.graphs)

    def _follow_model(self) -> None:
        """Re-bind after the model moved to another device or dtype (`.to()`), dropping the old cache."""
        weight = base_model(self.model).get_input_embeddings().weight
        if (weight.device, weight.dtype) != (self.device, self.dtype):
            self.release()
            self._bind()

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress_bar: bool | None = None, *, seed: int | None = None) -> list[GenerationResult]:
        """Generate a continuation for every prompt; results come back in input order.

        prompts: lists of token ids (ints, numpy or torch integers), or a 2-D tensor or array.
        params: one SamplingParams for all prompts, or one per prompt. Bad input raises ValueError before any work.
        seed: each request without a seed of its own derives a distinct one from it: the call is reproducible and
            the G copies of a GRPO prompt differ. None draws them from torch's global RNG.
        """
        base = base_model(self.model)
        requests = build_requests(prompts, params, seed, self.vocab_size, base.generation_config)
        if not requests:
            return []
        self._follow_model()
        check_fits(requests, base.config.get_text_config(), self.config.block_size, self._capacity_blocks())
        num_blocks = self.config.num_blocks or blocks_to_allocate(
            [r.max_tokens for r in requests], self.config.block_size, self.cache.bytes_per_block,
            self.config.max_cache_gib)
        show = self.config.progress_bar if progress_bar is None else progress_bar
        use_lora_kernels = self.config.lora_kernels and self.backend is not sdpa_paged
        with generation_mode(self.model) as modules, lora_kernels(self.model, use_lora_kernels, modules), tqdm(
                total=sum(r.params.max_new_tokens for r in requests), unit="tok", desc="cb_sync",
                disable=not (sys.stderr.isatty() if show is None else show)) as bar:
            self.cache.ensure(num_blocks)
            if self.graphs is not None:
                self.graphs.begin_call(max(blocks_for(r.max_tokens, self.config.block_size) for r in requests),
                                       modules)
            self._run(requests, bar)
        return [GenerationResult.of(r) for r in requests]

    def release(self) -> None:
        """Free the KV cache and captured graphs so their memory can serve training; the next generate()
        allocates and captures again."""
        self.cache.release()
        if self.graphs is not None:
            self.graphs.release()

    def _run(self, requests: list[Request], bar: tqdm) -> None:
        cfg = self.config
        scheduler = Scheduler(BlockAllocator(self.cache.num_blocks), cfg.block_size, cfg.max_batch_tokens,
                              cfg.max_batch_size, cfg.prefix_sharing)
        for request in requests:
            scheduler.add(request)
        while scheduler.has_work():
            plan = scheduler.schedule()
            if not plan:
                raise RuntimeError("the scheduler could not place any request in the cache")
            if self.runner.replays(plan):
                self._run_decode_chain(scheduler, plan, bar)
            else:
                self._finish_step(scheduler, plan, *self.runner.step(plan), bar)

    def _run_decode_chain(self, scheduler: Scheduler, plan: list, bar: tqdm) -> None:
        """Pure-decode steps back to back: each step is launched before the tokens of the one before it are read
        (it takes them on the device), so the host's work and the reads overlap the GPU's. A request that ends on
        a stop or EOS token has had one more row computed in the step after: that row is dropped, and a waiting
        request takes its place one step later than it would with steps run one at a time."""
        launched = self.runner.launch(plan)
        while True:
            following = scheduler.plan_ahead(plan)
            launched_next = self.runner.launch(following, ahead=True) if following else None
            self._finish_step(scheduler, plan, *self.runner.collect(plan, launched), bar)
            if following is None or launched_next.stale:    # stale: `plan` was redone (a TOP_K tie), so the step
                return                                        # after it runs again from schedule()
            if any(chunk.request.status is Status.FINISHED for chunk in following):
                sampled, tokens, logprobs = self.runner.collect(following, launched_next)
                live = [i for i, chunk in enumerate(following) if chunk.request.status is not Status.FINISHED]
                self._finish_step(scheduler, [following[i] for i in live], [sampled[i] for i in live],
                                  [tokens[i] for i in live], [logprobs[i] for i in live], bar)
                return
            plan, launched = following, launched_next

    @staticmethod
    def _finish_step(scheduler: Scheduler, plan: list, sampled: list[Request], tokens: list[int],
                     logprobs: list[float], bar: tqdm) -> None:
        """Append the sampled tokens, advance the scheduler, count progress."""
        for request, token, logprob in zip(sampled, tokens, logprobs):
            request.append(token, logprob)
        for request in scheduler.finish_step(plan):
            bar.update(request.params.max_new_tokens - len(request.output))
        bar.update(len(sampled))

    def _capacity_blocks(self) -> int:
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        return int(self.config.max_cache_gib * 2**30) // self.cache.bytes_per_block
