"""Pure-decode steps replayed: one graph per key (a bucket, a sampler kind, and the penalty kind of calls that use
penalties), captured for every bucket of a sampler kind at once; the static buffers they run over; replays launched
without waiting for their tokens, where a step launched after another whose tokens are not read yet takes them on the
device and is launched again if that step is redone after a top-k tie (`ReplayOutput`)."""

from __future__ import annotations

import time

import torch

from ..sampling.sampler import SamplerKind, sample, sampler_kind
from ..scheduler.plan import step_columns
from ..step.buffers import StepBuffers
from ..step.output import StepOutput
from .buckets import bucket_for, is_pure_decode
from .capture import DecodeGraphs, model_fingerprint


class DecodeReplay:
    """Static buffers at the largest bucket, the step a graph records (`decode_step`), captured for every bucket of a
    sampler kind at once, on that kind's first pure-decode step; `run` launches a plan's replay. forward:
    eager_forward or a CompiledForward."""

    def __init__(self, forward, cache, backend, tuning, buckets: list[int]):
        self.forward = forward
        self.cache = cache
        self.backend = backend
        self.tuning = tuning
        self.buckets = buckets
        self.max_batch = buckets[-1]
        self.graphs = DecodeGraphs(cache.device)
        self.width = 0                  # block table columns of the static buffers
        self.recorded = None            # what this call's graphs record besides the forward (`begin_call`)
        self.history = None             # the token history this call's penalties read (None: no penalties)
        self.latest = None              # the output launched last
        self.warmup_seconds = 0.0       # uncaptured first runs per bucket: compile, autotune, lazy init

    def begin_call(self, max_blocks_per_request: int, modules: list, penalties, history) -> None:
        """Widen the static buffers where a request needs more blocks, take those of the call's penalty terms
        (`runner.ModelRunner.begin_call`); drop the graphs if what they recorded changed (weights, adapters, buffers,
        autocast state, a failed compile, the token history's place, and the cache pools' addresses unless the
        backend's decode reads them at run time: then graphs outlive a release and the pools' new addresses)."""
        if max_blocks_per_request > self.width:
            self.width = 1 << (max_blocks_per_request - 1).bit_length()
            self._allocate_buffers()
        self.history = history
        if penalties not in self.buffer_sets:
            n = self.max_batch
            self.buffer_sets[penalties] = StepBuffers(n, n, self.width, n, n, self.cache.device, 2, penalties)
        self.buffers = self.buffer_sets[penalties]
        device, cache = self.cache.device.type, self.cache
        pools = ((cache.pool_offsets.data_ptr(),) if self.backend.DECODE_FOLLOWS_POOLS
                 else tuple(t.data_ptr() for t in (*cache.k_caches, *cache.v_caches)))
        tokens = None if history is None or history.ids is None else history.ids.data_ptr()
        self.recorded = (model_fingerprint(modules), self.width, pools, tokens, torch.is_autocast_enabled(device),
                         torch.get_autocast_dtype(device))
        self._keep_graphs_if_recorded()

    def _keep_graphs_if_recorded(self) -> None:
        """Keep the graphs only if they recorded this call's `recorded` state and the forward as it is now."""
        self.graphs.keep_if((self.recorded, getattr(self.forward, "active", None)))

    def _allocate_buffers(self) -> None:
        n, device = self.max_batch, self.cache.device
        self.buffer_sets = {}           # by PenaltyKind (None: no penalties): the static buffers of a call's steps
        self.out_tokens = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_logprobs = torch.zeros(n, device=device)
        self.out_tied = torch.zeros(n, dtype=torch.bool, device=device)
        # the outputs on the host, two in turn: one step's are read while the next step's are on their way (flat, so
        # that every step's [fields, rows] view is contiguous: a copy into a strided host view would wait for the step)
        self.out_host = [torch.zeros(3 * n, dtype=torch.float64, pin_memory=device.type == "cuda") for _ in range(2)]
        self.out_turn = 0

    def serves(self, plan) -> bool:
        return len(plan) <= self.max_batch and is_pure_decode(plan)

    def graph_key(self, bucket: int, kind: SamplerKind) -> tuple:
        """A graph per bucket and sampler kind, and per penalty kind in calls whose requests use penalties."""
        penalties = self.buffers.penalties
        return (bucket, kind) if penalties is None else (bucket, kind, penalties)

    def decode_step(self, bucket: int, kind: SamplerKind) -> None:
        """The decode step on the first `bucket` rows of the static buffers (what a graph records)."""
        ids, positions, meta, keep = self.buffers.model_inputs(bucket, bucket, bucket, self.cache, self.backend,
                                                               self.tuning, 1, self.width * self.cache.block_size)
        self.buffers.record_tokens(self.history, bucket)
        tokens, logprobs, tied = sample(self.forward(ids, positions, meta, keep),
                                        self.buffers.sampling(bucket, kind, self.history))
        self.out_tokens[:bucket].copy_(tokens)
        self.out_logprobs[:bucket].copy_(logprobs)
        if tied is not None:
            self.out_tied[:bucket].copy_(tied)

    def run(self, plan, after: ReplayOutput | None = None) -> ReplayOutput:
        """Launch the plan's replay; after: the step just launched, which the plan continues (see ModelRunner)."""
        bucket = bucket_for(len(plan), self.buckets)
        kind = sampler_kind(chunk.request.params for chunk in plan)
        if self.graph_key(bucket, kind) not in self.graphs:
            assert after is None, "a step launched ahead replays the graph of the step before it"
            self._capture_all(kind)
        if after is not None and after.stale:
            after.launch(ids_on_device=False)
        output = ReplayOutput(self, plan, bucket, kind, after is not None)
        output.launch(ids_on_device=after is not None)
        return output

    def warm_up(self, bucket: int | None = None, kind: SamplerKind = SamplerKind.GREEDY) -> None:
        """Run a bucket's step (None: the largest) once, uncaptured, on rows that store and read nothing: compile,
        autotune and lazy initialisation happen here."""
        start = time.perf_counter()
        self.write_inputs([], self.max_batch)
        self.decode_step(bucket or self.max_batch, kind)
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize()
        self.warmup_seconds += time.perf_counter() - start

    def _capture_all(self, kind: SamplerKind) -> None:
        """Warm up and capture every bucket for this sampler, largest first; all again uncompiled if a compile fails
        (then, as after a compile that failed earlier in the call, the graphs the compiled forward recorded go)."""
        self._keep_graphs_if_recorded()
        active = getattr(self.forward, "active", None)
        for bucket in reversed(self.buckets):
            self.warm_up(bucket, kind)
            if getattr(self.forward, "active", None) != active:
                return self._capture_all(kind)
            self.graphs.capture(self.graph_key(bucket, kind), lambda b=bucket: self.decode_step(b, kind))

    def write_inputs(self, plan, bucket: int) -> None:
        columns = step_columns(plan, self.cache.block_size)
        columns.pad_requests(bucket)
        self.buffers.write(columns)
        self.buffers.upload()

    def outputs(self, n: int, kind: SamplerKind) -> torch.Tensor:
        """The last step's outputs as float64 rows [fields, n]: tokens, logprobs and (CANDIDATES) tied flags."""
        outputs = [self.out_tokens[:n], self.out_logprobs[:n]]
        outputs += [self.out_tied[:n]] if kind is SamplerKind.CANDIDATES else []
        return torch.stack([t.double() for t in outputs])


class ReplayOutput(StepOutput):
    """A replayed step whose outputs are on their way to the host. A CANDIDATES step whose top-k tie ran past the
    candidates (rare) is redone uncaptured over the sorted vocabulary; the step launched after it took the tie's
    token, so it is marked stale and launched again before it is read or followed."""

    keeps_tokens_on_device = True

    def __init__(self, replay: DecodeReplay, plan, bucket: int, kind: SamplerKind, ahead: bool):
        super().__init__(plan, "replay", kind, ahead)
        self.replay, self.bucket = replay, bucket
        self.stale = False
        self.relaunched = False     # launched again after it went stale
        self.redone = False         # redone over the sorted vocabulary after a tie

    def launch(self, ids_on_device: bool) -> None:
        replay, n = self.replay, len(self.plan)
        if self.stale:
            self.stale, self.relaunched = False, True
        replay.write_inputs(self.plan, self.bucket)
        if ids_on_device:
            replay.buffers.views["input_ids"][:n].copy_(replay.out_tokens[:n])
        replay.graphs.replay(replay.graph_key(self.bucket, self.kind))
        outputs = replay.outputs(n, self.kind)
        self.host = replay.out_host[replay.out_turn][:outputs.numel()].view(outputs.shape)
        replay.out_turn ^= 1
        self.host.copy_(outputs, non_blocking=True)
        self.done = None
        if replay.cache.device.type == "cuda":        # pinned host buffers: the copy is asynchronous
            self.done = torch.cuda.Event()
            self.done.record(torch.cuda.current_stream(replay.cache.device))
        replay.latest = self

    def wait(self) -> list[list[float]]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()

    def read(self) -> tuple[list[int], list[float]]:
        if self.stale:
            self.launch(ids_on_device=False)
        rows = self.wait()
        if self.kind is SamplerKind.CANDIDATES and any(rows[2]):
            rows = self._redo()
        return [int(t) for t in rows[0]], rows[1]

    def _redo(self) -> list[list[float]]:
        replay, n = self.replay, len(self.plan)
        if replay.latest is not self:
            replay.latest.wait()
            replay.latest.stale = True
            replay.write_inputs(self.plan, self.bucket)
        replay.decode_step(self.bucket, SamplerKind.SORTED)
        self.redone = True
        return replay.outputs(n, SamplerKind.SORTED).tolist()
