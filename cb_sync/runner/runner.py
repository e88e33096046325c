"""ModelRunner.execute: a step's plan in, its output back: a replayed graph for pure decode, else the model's forward
(compiled where the decode step is) over inputs packed for the step."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..attention import StepBackends
from ..cache import PagedAttentionCache
from ..graphs import CompiledForward, DecodeReplay, eager_forward, is_pure_decode
from ..graphs.compiled import pad_counts
from ..sampling.penalties import PenaltyKind, TokenHistory, penalty_kind
from ..sampling.sampler import SamplerKind, sample_exactly, sampler_kind
from ..scheduler.plan import step_columns
from ..step import EagerOutput, StepBuffers, StepOutput
from ..tuning import AttentionTuning


@dataclass(eq=False)
class ModelRunner:
    """Executes plans (lists of ScheduledChunks). backends: the attention backend of pure-decode steps and that of
    steps with prompt tokens; replay: the executor of pure-decode steps (None: every step runs uncaptured); compiled:
    the forward of the other steps (None: eager); observer: called with each step's output; penalties: the penalty
    terms of this call's steps (`begin_call`), which read the tokens every step stores in `history`."""

    model: torch.nn.Module
    cache: PagedAttentionCache
    backends: StepBackends
    tuning: AttentionTuning
    replay: DecodeReplay | None = None
    compiled: CompiledForward | None = None
    observer: Callable[[StepOutput], None] | None = None
    penalties: PenaltyKind | None = field(default=None, init=False)
    history: TokenHistory = field(init=False)

    def __post_init__(self):
        assert self.compiled is None or self.replay is not None, "a compiled forward needs the decode replay's width"
        self.history = TokenHistory(self.cache.block_size, self.cache.device)

    def begin_call(self, requests, max_blocks_per_request: int, modules: list) -> None:
        """Prepare for a call's requests, over a cache already sized for them: the penalty terms their steps compute
        and the token history those read; the replay's buffers and graphs (`DecodeReplay.begin_call`)."""
        self.penalties = penalty_kind(requests)
        if self.penalties is not None and self.penalties.reads_history:
            self.history.ensure(self.cache.num_blocks * self.cache.block_size)
        if self.replay is not None:
            self.replay.begin_call(max_blocks_per_request, modules, self.penalties, self.history)

    def release(self, keep_graphs: bool) -> None:
        """Free the captured graphs unless keep_graphs, and the token history unless graphs that read it are kept."""
        if self.replay is not None and not keep_graphs:
            self.replay.release()
        if self.replay is None or not keep_graphs:
            self.history.release()

    def execute(self, plan, after: StepOutput | None = None) -> StepOutput:
        """Launch the plan. after: the step just launched, not read yet, that the plan continues (`plan_ahead`: the
        same requests one position on); its output must keep its tokens on the device, where this step takes them."""
        started = time.perf_counter()
        kind = sampler_kind(chunk.request.params for chunk in plan if chunk.samples)
        if self.replay is not None and self.replay.serves(plan):
            output = self.replay.run(plan, kind, after)
        else:
            assert after is None, "only a replayed step continues a step not read yet"
            output = self._run_uncaptured(plan, kind)
        output.started_at = started
        if self.observer is not None:
            self.observer(output)
        return output

    def _run_uncaptured(self, plan, kind: SamplerKind) -> EagerOutput:
        columns = step_columns(plan, self.cache.block_size)
        compiled = self.compiled is not None and self.compiled.active and \
            len(columns.input_ids) <= self.compiled.max_tokens
        if compiled and self.compiled.from_embeddings is None:
            self.replay.warm_up()             # the compile runs on the decode step and counts as its warm-up
            compiled = self.compiled.active
        if compiled:        # the compiled step's counts, and its table width
            pad_counts(columns)
        width = self.replay.width if compiled else max(len(blocks) for blocks in columns.tables)
        buffers = StepBuffers.packed(columns, width, self.cache.device, self.penalties)
        backend = self.backends.decode if is_pure_decode(plan) else self.backends.prefill
        ids, positions, meta, keep = buffers.model_inputs(
            len(columns.input_ids), len(columns.seq_lens), len(columns.keep), self.cache, backend, self.tuning,
            max(chunk.length for chunk in plan), max(columns.seq_lens))
        buffers.record_tokens(self.history, len(columns.input_ids))
        logits = (self.compiled if compiled else eager_forward(self.model))(ids, positions, meta, keep)
        sampled = len(columns.samplers)
        batch = buffers.sampling(sampled, kind, self.history)
        tokens, logprobs = sample_exactly(logits[:sampled], batch) if sampled else \
            (logits.new_empty(0, dtype=torch.int64), logits.new_empty(0))
        return EagerOutput(plan, "compiled" if compiled else "eager", kind, tokens, logprobs)
