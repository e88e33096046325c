"""ModelRunner: runs one step's plan and returns its output (`execute`): a replayed decode graph for pure-decode
plans, otherwise the model's forward (compiled where the decode step is) over inputs packed for the step."""

from __future__ import annotations

import time

import torch

from ..sampling import sample_exactly, sampler_kind
from ..tuning import AttentionTuning
from .compiled import CompiledForward, model_logits
from .inputs import StepBuffers, step_columns
from .output import EagerOutput, StepOutput
from .replay import DecodeReplay


class ModelRunner:
    """Executes plans (lists of ScheduledChunks) on the model with the paged cache and attention backend.

    replay: the replay executor of pure-decode steps, or None (every step then runs uncaptured). compiled: the
    compiled forward for steps that are not pure decode, or None (they run eagerly). observer: called with every
    step's output as it is launched."""

    def __init__(self, model: torch.nn.Module, cache, backend, tuning: AttentionTuning,
                 replay: DecodeReplay | None = None, compiled: CompiledForward | None = None, observer=None):
        self.model = model
        self.cache = cache
        self.backend = backend
        self.tuning = tuning
        self.replay = replay
        self.compiled = compiled
        self.observer = observer

    def execute(self, plan, after: StepOutput | None = None) -> StepOutput:
        """Launch the plan. after: the output of the step just launched, not read yet, that this plan continues (the
        same requests one position on, planned by `Scheduler.plan_ahead`): this step takes its tokens on the
        device. Only an output that `keeps_tokens_on_device` can be continued so."""
        started = time.perf_counter()
        if self.replay is not None and self.replay.serves(plan):
            output = self.replay.run(plan, after)
        else:
            assert after is None, "only a replayed step continues a step not read yet"
            output = self._run_uncaptured(plan)
        output.started_at = started
        if self.observer is not None:
            self.observer(output)
        return output

    def _run_uncaptured(self, plan) -> EagerOutput:
        columns = step_columns(plan, self.cache.block_size)
        compiled = self.compiled is not None and self.compiled.active and \
            len(columns.input_ids) <= self.compiled.max_tokens
        if compiled and self.compiled.from_embeddings is None:
            self.replay.warm_up()             # the compile runs on the decode step and counts as its warm-up
            compiled = self.compiled.active
        if compiled:        # the compiled step's counts: at least two requests and two rows kept, its table width
            columns.pad_requests(2)
            columns.keep += (columns.keep[-1:] or [0]) * (2 - len(columns.keep))
        width = self.replay.width if compiled else max(len(blocks) for blocks in columns.tables)
        buffers = StepBuffers.packed(columns, width, self.cache.device)
        ids, positions, meta, keep = buffers.model_inputs(
            len(columns.input_ids), len(columns.seq_lens), len(columns.keep), self.cache, self.backend, self.tuning,
            max(chunk.length for chunk in plan), max(columns.seq_lens))
        if compiled:
            logits = self.compiled(ids, positions, meta, keep)
        else:
            logits = model_logits(self.model, {"input_ids": ids}, positions, meta, keep)
        sampled = len(columns.samplers)
        kind = sampler_kind(request.params for request in columns.samplers)
        tokens, logprobs = sample_exactly(logits[:sampled], buffers.sampling(sampled, kind)) if sampled else \
            (logits.new_empty(0, dtype=torch.int64), logits.new_empty(0))
        return EagerOutput(plan, "compiled" if compiled else "eager", kind, tokens, logprobs)
