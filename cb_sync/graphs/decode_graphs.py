"""Captured pure-decode steps: static buffers at the largest bucket, one graph per (bucket, sampling mode),
all in one memory pool, re-captured whenever what they recorded (weights, adapters, cache, widths) changes.
Compiled, the decode step's function also runs the other steps (prefill chunks, mixed batches), uncaptured."""

from __future__ import annotations

import functools
import time
import warnings

import torch
from torch._dynamo.exc import TorchDynamoException
from torch.fx.experimental import _config as shape_config
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

from ..attention import AttnMetadata
from ..lora.fast_forward import KERNEL_MAX_ELEMENTS
from ..model_state import base_model
from ..patching import module_list
from ..sampling import SamplingBatch, sample, sampling_columns, uses_candidates
from .buckets import bucket_for, decode_buckets
from .step_inputs import StepInputs

GREEDY, SAMPLE, TOP_K, FILTERED = 0, 1, 2, 3


def sampling_mode(batch_params) -> int:
    """The cheapest sampler that serves every row: greedy, plain sampling, filters on the top candidates only
    (every sampling row has a small top_k: sampling.uses_candidates), or filters that may sort the vocabulary."""
    batch_params = list(batch_params)
    if not any(p.do_sample for p in batch_params):
        return GREEDY
    if not any(p.filtered for p in batch_params):
        return SAMPLE
    return TOP_K if uses_candidates(batch_params) else FILTERED


def model_fingerprint(model: torch.nn.Module, modules: list | None = None) -> tuple:
    """Everything a captured graph bakes in about the model: parameter storages and dtypes, adapter state
    (modules: the model's modules if already walked, see `patching.module_list`)."""
    modules = module_list(model) if modules is None else modules
    params = tuple((p.data_ptr(), p.dtype) for m in modules for p in m._parameters.values() if p is not None)
    # PEFT's tuner layers, told by a class attribute (no __getattr__ miss)
    tuners = [(i, m) for i, m in enumerate(modules) if hasattr(type(m), "merged_adapters")]
    adapters = tuple((i, repr(getattr(m, "active_adapters", None)), repr(m.merged_adapters),
                      getattr(m, "disable_adapters", None)) for i, m in tuners)
    return params, adapters


def model_logits(model, inputs: dict, positions, meta, keep: torch.Tensor):
    """Logits of the rows `keep` from `input_ids` or (compiled) `inputs_embeds`: the part of a step that
    torch.compile may take."""
    return model(**inputs, position_ids=positions, cb_meta=meta, logits_to_keep=keep, use_cache=False).logits[0]


COMPILE_OPTIONS = {"combo_kernels": True}   # independent elementwise kernels (the q and k norms and rotary
# embeddings, ...) in one launch: batch 32's compiled step 5.63 -> 5.31 ms (benchmarks/NOTES.md, attempt 11)


@functools.cache
def compiled_model_logits():
    """One compiled function for every driver: dynamo caches per code object and guards on the model passed."""
    return torch.compile(model_logits, options=COMPILE_OPTIONS)


class DecodeGraphs:
    """Replays a captured decode step for plans where every request feeds one token and samples the next;
    compiled, also runs the other steps through the same compiled function (`logits`), uncaptured."""

    def __init__(self, model: torch.nn.Module, cache, backend, max_batch_size: int, compile_model: bool):
        self.model = model
        self.cache = cache
        self.backend = backend
        # Compiled, size 1 would be specialised into a second compile: one request pads to two rows instead.
        self.buckets = [b for b in decode_buckets(max_batch_size) if not compile_model or b > 1 or max_batch_size == 1]
        self.max_batch = self.buckets[-1]
        self.compiled = compile_model
        self.forward = compiled_model_logits() if compile_model else model_logits
        self.from_embeddings = None   # compiled: start from embeddings (decided at the first warm-up)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.width = 0
        self.fingerprint = None
        self.latest = None                      # the step launched last
        self.warmup_seconds = 0.0               # uncaptured first runs per bucket: compile, autotune, lazy init
        self.capture_seconds = 0.0
        output = base_model(model).get_output_embeddings()     # (it sees the kept rows only)
        head = {id(m) for m in output.modules()} if output is not None else set()
        widest = max((max(m.in_features, m.out_features) for m in model.modules()
                      if isinstance(m, torch.nn.Linear) and id(m) not in head), default=1)
        self.max_compiled_tokens = KERNEL_MAX_ELEMENTS // widest   # within the LoRA kernel's int32 offsets: the
        # compiled step has no fallback to PEFT's forward for larger steps (an eager step has)

    # -- lifecycle ------------------------------------------------------------------------------------------

    def begin_call(self, max_blocks_per_request: int, modules: list | None = None) -> None:
        """Drop stale graphs before a call: new weights storage, adapters, cache pools, autocast state or a wider
        block table (modules: the model's modules if already walked)."""
        device = self.cache.device.type
        fingerprint = (model_fingerprint(self.model, modules), tuple(t.data_ptr() for t in self.cache.k_caches),
                       tuple(t.data_ptr() for t in self.cache.v_caches),
                       torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        if max_blocks_per_request > self.width:
            self.width = 1 << (max_blocks_per_request - 1).bit_length()
            self._allocate_buffers()
            self.release()
        elif fingerprint != self.fingerprint:
            self.release()
        self.fingerprint = fingerprint

    def release(self) -> None:
        """Free every captured graph and its memory pool."""
        self.graphs.clear()
        self.pool = None

    def _allocate_buffers(self) -> None:
        n, device = self.max_batch, self.cache.device
        self.step_inputs = StepInputs(n, self.width, device)
        fields = self.step_inputs.views
        self.input_ids, self.positions, self.slots = fields["input_ids"], fields["positions"], fields["slots"]
        self.tables, self.seq_lens = fields["tables"], fields["seq_lens"]
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, device=device)
        self.sampling = SamplingBatch(
            do_sample=fields["do_sample"], temperature=fields["temperature"], top_k=fields["top_k"],
            top_p=fields["top_p"], min_p=fields["min_p"], seeds=fields["seeds"], positions=fields["sample_positions"],
            any_sample=False, any_filter=False)
        self.out_tokens = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_logprobs = torch.zeros(n, device=device)
        self.out_tied = torch.zeros(n, dtype=torch.bool, device=device)
        # the outputs on the host, two in turn: one step's are read while the next step's are on their way (flat, so
        # that every step's [fields, rows] view is contiguous: a copy into a strided host view would wait for the step)
        self.out_host = [torch.zeros(3 * n, dtype=torch.float64, pin_memory=device.type == "cuda") for _ in range(2)]
        self.out_turn = 0

    # -- the step -------------------------------------------------------------------------------------------

    def step(self, bucket: int, mode: int) -> None:
        """The decode step on the first `bucket` rows of the static buffers (what a graph records)."""
        ids, positions, meta = self._inputs(bucket)
        logits = self._logits(ids, positions, meta, self.rows[:bucket])
        s = self.sampling
        params = SamplingBatch(s.do_sample[:bucket], s.temperature[:bucket], s.top_k[:bucket], s.top_p[:bucket],
                               s.min_p[:bucket], s.seeds[:bucket], s.positions[:bucket],
                               any_sample=mode != GREEDY, any_filter=mode in (TOP_K, FILTERED),
                               sort_vocabulary=mode != TOP_K)
        tokens, logprobs, tied = sample(logits, params)
        self.out_tokens[:bucket].copy_(tokens)
        self.out_logprobs[:bucket].copy_(logprobs)
        if mode == TOP_K:
            self.out_tied[:bucket].copy_(tied)

    def _logits(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                keep: torch.Tensor) -> torch.Tensor:
        """Logits of the rows `keep`. Compiled, every count (tokens, requests, rows kept, cache blocks) is a
        dynamic dimension, each its own symbol, so that one compile serves every bucket, every cache size and the
        steps that are not pure decode."""
        inputs = {"input_ids": ids}
        if not self.compiled:
            return self.forward(self.model, inputs, positions, meta, keep)
        if self.from_embeddings:
            inputs = {"inputs_embeds": self._embed(ids)}
        counted = (*inputs.values(), positions, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                   meta.query_start_loc, keep)
        for t, dim in zip(counted, (1, 1, 0, 0, 0, 0, 0)):
            torch._dynamo.mark_dynamic(t, dim)
        for cache in (*self.cache.k_caches, *self.cache.v_caches):
            torch._dynamo.mark_dynamic(cache, 0)
        # a decode step's counts are equal (tokens = requests = rows kept): duck shaping would make them one symbol
        with shape_config.patch(use_duck_shape=False):
            return self.forward(self.model, inputs, positions, meta, keep)

    def runs_steps(self, num_tokens: int) -> bool:
        """Whether steps that are not pure decode, of this many tokens, run through the compiled decode step (not
        where a bucket of one request was compiled: its counts of one are specialised, so a step padded to two
        would compile again)."""
        return self.compiled and self.buckets[0] > 1 and num_tokens <= self.max_compiled_tokens

    def logits(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
               keep: torch.Tensor) -> torch.Tensor | None:
        """Logits of the rows `keep` of a step that is not pure decode, through the compiled decode step (if
        nothing is compiled yet, the decode step is first warmed up uncaptured: the compile's time counts as
        warm-up, not as this step's). The batch has at least two requests and two rows kept (a compiled count of
        one would be specialised). None if the compile failed: the caller runs the step eagerly."""
        if self.from_embeddings is None:          # (the compiled function leaves sampling out: any mode will do)
            self._reset_static_inputs()
            self._timed_warm_up(self.max_batch, GREEDY)
        if not self.compiled:
            return None
        return self._logits(ids, positions, meta, keep)

    def _inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata]:
        """Token ids [1, bucket], positions [1, bucket] and attention metadata: views of the static buffers."""
        meta = AttnMetadata(self.slots[:bucket], self.tables[:bucket], self.seq_lens[:bucket],
                            self.query_start[:bucket + 1], 1, self.width * self.cache.block_size,
                            self.cache.k_caches, self.cache.v_caches, self.backend)
        return self.input_ids[:bucket].unsqueeze(0), self.positions[:bucket].unsqueeze(0), meta

    def _capture_all(self, mode: int) -> None:
        """Capture every bucket for this sampling mode, largest first, into the shared pool."""
        self._reset_static_inputs()
        if self.cache.device.type != "cuda":       # no capture off CUDA: replay runs the step itself
            if self.compiled:
                self._timed_warm_up(self.max_batch, mode)
            self.graphs.update({(b, mode): _EagerStep(self.step, b, mode) for b in self.buckets})
            return
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            if not self._timed_warm_up(bucket, mode):     # the compile failed: capture every bucket anew, uncompiled
                return self._capture_all(mode)
            start = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.step(bucket, mode)
            self.graphs[(bucket, mode)] = graph
            torch.cuda.synchronize()
            self.capture_seconds += time.perf_counter() - start

    def _reset_static_inputs(self) -> None:
        """Rows that store nothing and read no cache, for steps run outside a real batch (warm-up, capture)."""
        self.slots.fill_(-1)
        self.seq_lens.zero_()
        self.tables.zero_()

    def _timed_warm_up(self, bucket: int, mode: int) -> bool:
        """`_warm_up`, its time (to the end of its GPU work) added to warmup_seconds."""
        start = time.perf_counter()
        warmed = self._warm_up(bucket, mode)
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize()
        self.warmup_seconds += time.perf_counter() - start
        return warmed

    def _warm_up(self, bucket: int, mode: int) -> bool:
        """Run the step once before its capture (compile, autotune, lazy init). A compile that fails warns and
        leaves the step uncompiled (generation goes on, slower), drops every graph captured so far (they ran the
        compiled step) and returns False."""
        if self.compiled and self.from_embeddings is None:
            self.from_embeddings = self._same_logits_from_embeddings(bucket)
        try:
            self.step(bucket, mode)
            return True
        except (TorchDynamoException, ConstraintViolationError) as error:
            if not self.compiled:
                raise
            warnings.warn(f"torch.compile of the decode step failed, running it uncompiled: "
                          f"{type(error).__name__}: {str(error)[:300]}", RuntimeWarning, stacklevel=3)
            self.compiled, self.forward = False, model_logits
            self.graphs.clear()
            return False

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding lookup, outside the compiled function: hooks on the embedding layer (TRL's trainer adds
        one through `enable_input_require_grads`, calling `requires_grad_`) would break the compiled graph."""
        return base_model(self.model).get_input_embeddings()(ids)

    def _same_logits_from_embeddings(self, bucket: int) -> bool:
        """Whether the model's forward gives the same logits from looked-up embeddings as from the ids (not so
        for models with per-layer token inputs, such as Gemma-3n), checked uncompiled on the static buffers."""
        ids, positions, meta = self._inputs(bucket)
        try:
            from_embeddings = model_logits(self.model, {"inputs_embeds": self._embed(ids)}, positions, meta,
                                           self.rows[:bucket])
        except (RuntimeError, ValueError):      # a forward that refuses embeddings alone
            return False
        from_ids = model_logits(self.model, {"input_ids": ids}, positions, meta, self.rows[:bucket])
        return bool(((from_ids == from_embeddings) | (from_ids.isnan() & from_embeddings.isnan())).all())

    def launch(self, requests, ahead: bool = False) -> _Launched:
        """Fill the static buffers, replay the bucket's graph and start copying its outputs to the host.

        ahead: the requests of the step just launched, each one position further on, fed the tokens that step
        samples (taken on the device, so this step can be queued before that one's tokens are read; its graph
        was captured for that step)."""
        n = len(requests)
        bucket = bucket_for(n, self.buckets)
        mode = sampling_mode(r.params for r in requests)
        if (bucket, mode) not in self.graphs:
            assert not ahead, "a step launched ahead replays the graph of the step before it"
            self._capture_all(mode)
        self._fill_host(requests, bucket, mode, int(ahead))
        self.step_inputs.upload()
        if ahead:
            self.input_ids[:n].copy_(self.out_tokens[:n])
        self.graphs[(bucket, mode)].replay()
        outputs = self._outputs(n, mode)
        host = self.out_host[self.out_turn][:outputs.numel()].view(outputs.shape)
        self.out_turn ^= 1
        host.copy_(outputs, non_blocking=True)
        done = None
        if self.cache.device.type == "cuda":        # pinned host buffers: the copy is asynchronous
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.cache.device))
        self.latest = _Launched(bucket, mode, host, done)
        return self.latest

    def collect(self, launched: _Launched, requests) -> tuple[list[int], list[float]]:
        """Wait for a launched step of these requests and read its tokens and logprobs.

        A TOP_K step whose top-k tie ran past the candidates (rare) is redone uncaptured over the sorted
        vocabulary. If a step was launched after it, that step read the tie's token and holds the static inputs:
        it is waited for and marked stale (its outputs are not to be used), and the inputs are written again."""
        tokens, logprobs, tied = launched.read()
        if any(tied):
            n = len(tokens)
            if self.latest is not launched:
                self.latest.read()
                self.latest.stale = True
                self._fill_host(requests, launched.bucket, launched.mode, 0)
                self.step_inputs.upload()
            self.step(launched.bucket, FILTERED)
            tokens, logprobs, _ = _Launched(launched.bucket, FILTERED, self._outputs(n, FILTERED), None).read()
        return tokens, logprobs

    def _outputs(self, n: int, mode: int) -> torch.Tensor:
        """The last step's outputs as float64 rows [fields, n]: tokens, logprobs and (TOP_K mode) tied flags."""
        outputs = [self.out_tokens[:n], self.out_logprobs[:n]] + ([self.out_tied[:n]] if mode == TOP_K else [])
        return torch.stack([t.double() for t in outputs])

    def _fill_host(self, requests, bucket: int, mode: int, ahead: int) -> None:
        host, block_size, n = self.step_inputs.host, self.cache.block_size, len(requests)
        ids, positions, slots = [], [], []
        tables = host["tables"]
        tables[:bucket] = 0                 # padded rows: no stale block ids from an earlier, larger cache
        for i, r in enumerate(requests):
            p = r.num_computed + ahead
            ids.append(0 if ahead else r.token_slice(p, p + 1)[0])
            positions.append(p)
            slots.append(r.blocks[p // block_size] * block_size + p % block_size)
            tables[i, :len(r.blocks)] = r.blocks
        pad = bucket - n
        host["input_ids"][:bucket] = ids + [0] * pad
        host["positions"][:bucket] = positions + [0] * pad
        host["slots"][:bucket] = slots + [-1] * pad
        host["seq_lens"][:bucket] = [p + 1 for p in positions] + [0] * pad
        if mode != GREEDY:                          # a greedy graph reads no sampling column
            for name, (values, _) in sampling_columns(requests, ahead).items():
                host["sample_positions" if name == "positions" else name][:n] = values


class _Launched:
    """A replayed step whose outputs (`DecodeGraphs._outputs`) are on their way to the host, or already there."""

    def __init__(self, bucket: int, mode: int, host: torch.Tensor, done):
        self.bucket, self.mode, self.host, self.done = bucket, mode, host, done
        self.stale = False     # the step before it was redone after it had read that step's tokens

    def read(self) -> tuple[list[int], list[float], list[bool]]:
        if self.done is not None:
            self.done.synchronize()
        rows = self.host.tolist()
        tied = [bool(t) for t in rows[2]] if self.mode == TOP_K else [False] * len(rows[0])
        return [int(t) for t in rows[0]], rows[1], tied


class _EagerStep:
    """Stands in for a CUDA graph off CUDA, so the static-buffer path runs (and is tested) on the CPU."""

    def __init__(self, step, bucket: int, mode: int):
        self.step, self.bucket, self.mode = step, bucket, mode

    def replay(self) -> None:
        self.step(self.bucket, self.mode)
