"""Pure-decode steps replayed: one graph per key (a bucket, a sampler kind, and the penalty kind of calls that use
penalties), captured for every bucket of a sampler kind at once; the static buffers they run over; replays launched
without waiting for their tokens, where a step launched after another whose tokens are not read yet takes them on the
device and is launched again if that step is redone after a top-k tie (`ReplayOutput`)."""

from __future__ import annotations

import torch

from ..sampling.penalties import PenaltyKind
from ..sampling.sampler import SamplerKind, sample
from ..scheduler.plan import step_columns
from ..step.buffers import StepBuffers
from ..step.output import StepOutput
from .buckets import bucket_for, is_pure_decode
from .capture import DecodeGraphs, model_fingerprint


class DecodeReplay:
    """Static buffers at the largest bucket, the step a graph records (`decode_step`), captured for every bucket of a
    sampler kind at once, on that kind's first pure-decode step; `run` launches a plan's replay. forward:
    eager_forward or a CompiledForward. It owns the state its outputs share (the device and host outputs, which output
    was launched last, which is stale): a `ReplayOutput` reads it and asks the replay to launch or redo it."""

    def __init__(self, forward, cache, backend, tuning, buckets: list[int]):
        n, device = buckets[-1], cache.device
        self.forward = forward
        self.cache = cache
        self.backend = backend
        self.tuning = tuning
        self.buckets = buckets
        self.max_batch = n
        self.graphs = DecodeGraphs(device)
        self.width = 0                  # block table columns of the static buffers
        self.buffer_sets: dict[PenaltyKind | None, StepBuffers] = {}    # the static buffers at this width, by
                                                                        # penalty kind (None: no penalties)
        self.buffers: StepBuffers | None = None     # this call's (`begin_call`)
        self.recorded = None            # what this call's graphs record besides the forward (`begin_call`)
        self.history = None             # the token history this call's penalties read (None: no penalties)
        self.out_tokens = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_logprobs = torch.zeros(n, device=device)
        self.out_tied = torch.zeros(n, dtype=torch.bool, device=device)
        # the outputs on the host, two in turn: one step's are read while the next step's are on their way (flat, so
        # that every step's [fields, rows] view is contiguous: a copy into a strided host view would wait for the step)
        self.out_host = [torch.zeros(3 * n, dtype=torch.float64, pin_memory=device.type == "cuda") for _ in range(2)]
        self.out_turn = 0
        self.latest: ReplayOutput | None = None     # the output launched last
        self.stale: ReplayOutput | None = None      # an output launched after a step later redone, which took that
                                                    # step's tied token: launched again before it is read or followed

    def begin_call(self, max_blocks_per_request: int, modules: list, penalties, history) -> None:
        """Widen the static buffers where a request needs more blocks, take those of the call's penalty terms
        (`runner.ModelRunner.begin_call`); drop the graphs if what they recorded changed (weights, adapters, buffers,
        autocast state, a failed compile, the token history's place, and the cache pools' addresses unless the
        backend's decode reads them at run time: then graphs outlive a release and the pools' new addresses)."""
        if max_blocks_per_request > self.width:
            self.width = 1 << (max_blocks_per_request - 1).bit_length()
            self.buffer_sets = {}
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

    def release(self) -> None:
        """Free the captured graphs and their memory pool."""
        self.graphs.release()

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

    def run(self, plan, kind: SamplerKind, after: ReplayOutput | None = None) -> ReplayOutput:
        """Launch the plan's replay with its rows' sampler; after: the step just launched, which the plan continues
        (see ModelRunner)."""
        bucket = bucket_for(len(plan), self.buckets)
        if self.graph_key(bucket, kind) not in self.graphs:
            assert after is None, "a step launched ahead replays the graph of the step before it"
            self._capture_all(kind)
        if after is not None and after.stale:
            after.launch(ids_on_device=False)
        output = ReplayOutput(self, plan, bucket, kind, after is not None)
        output.launch(ids_on_device=after is not None)
        return output

    def launch(self, output: ReplayOutput, ids_on_device: bool) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Replay an output's graph over its plan's inputs (the input ids those the last step sampled, on the device,
        where ids_on_device) and start the copy of its outputs to the next host buffer. Returns that buffer's view
        and the copy's event (None off CUDA, where the copy is done)."""
        n = len(output.plan)
        if self.stale is output:
            self.stale = None
        self.write_inputs(output.plan, output.bucket)
        if ids_on_device:
            self.buffers.views["input_ids"][:n].copy_(self.out_tokens[:n])
        self.graphs.replay(self.graph_key(output.bucket, output.kind))
        outputs = self.outputs(n, output.kind)
        host = self.out_host[self.out_turn][:outputs.numel()].view(outputs.shape)
        self.out_turn ^= 1
        host.copy_(outputs, non_blocking=True)
        done = None
        if self.cache.device.type == "cuda":        # pinned host buffers: the copy is asynchronous
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.cache.device))
        self.latest = output
        return host, done

    def redo(self, output: ReplayOutput) -> list[list[float]]:
        """An output's step again, uncaptured, over the sorted vocabulary (after a top-k tie ran past the candidates);
        the output launched after it, which took the tie's token, is then stale. Returns the outputs' rows."""
        if self.latest is not output:
            self.latest.wait()
            self.stale = self.latest
            self.write_inputs(output.plan, output.bucket)
        self.decode_step(output.bucket, SamplerKind.SORTED)
        return self.outputs(len(output.plan), SamplerKind.SORTED).tolist()

    def warm_up(self, bucket: int | None = None, kind: SamplerKind = SamplerKind.GREEDY) -> None:
        """Run a bucket's step (None: the largest) once, uncaptured, on rows that store and read nothing: compile,
        autotune and lazy initialisation happen here."""
        self.write_inputs([], self.max_batch)
        self.decode_step(bucket or self.max_batch, kind)
        if self.cache.device.type == "cuda":
            torch.cuda.synchronize()

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
    token, so it is stale (`DecodeReplay.stale`) and launched again before it is read or followed. relaunched: it was
    launched again; redone: it was redone after a tie."""

    keeps_tokens_on_device = True

    def __init__(self, replay: DecodeReplay, plan, bucket: int, kind: SamplerKind, ahead: bool):
        super().__init__(plan, "replay", kind, ahead)
        self.replay, self.bucket = replay, bucket
        self.host: torch.Tensor | None = None       # its outputs [fields, rows] on the host, once `done`
        self.done: torch.cuda.Event | None = None   # the copy to `host` (None: done)
        self.relaunched = False
        self.redone = False

    @property
    def stale(self) -> bool:
        return self.replay.stale is self

    def launch(self, ids_on_device: bool) -> None:
        self.relaunched = self.relaunched or self.stale
        self.host, self.done = self.replay.launch(self, ids_on_device)

    def wait(self) -> list[list[float]]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()

    def read(self) -> tuple[list[int], list[float]]:
        if self.stale:
            self.launch(ids_on_device=False)
        rows = self.wait()
        if self.kind is SamplerKind.CANDIDATES and any(rows[2]):
            rows = self.replay.redo(self)
            self.redone = True
        return [int(t) for t in rows[0]], rows[1]
