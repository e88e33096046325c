"""The step plan: which requests a step feeds and which of their tokens (`ScheduledChunk`), and those as the columns
the step's inputs are built from (`step_columns`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request


@dataclass(slots=True)
class ScheduledChunk:
    """request feeds tokens [start, start + length); it samples when that reaches its last token (or goes past it:
    a step planned ahead feeds a token not sampled yet)."""

    request: Request
    start: int
    length: int

    @property
    def samples(self) -> bool:
        return self.start + self.length >= self.request.num_tokens


@dataclass(slots=True)
class StepColumns:
    """A step's inputs as host lists: per token, per request, per sampling row (row kept, request, output index, the
    request's row)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    query_start: list[int] = field(default_factory=lambda: [0])
    tables: list[list[int]] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)
    samplers: list[Request] = field(default_factory=list)
    sample_positions: list[int] = field(default_factory=list)
    sampler_rows: list[int] = field(default_factory=list)

    def pad_requests(self, num_requests: int) -> None:
        """Add requests of one query each that read and store nothing, up to num_requests."""
        pad, last = num_requests - len(self.seq_lens), self.query_start[-1]
        for column, fill in ((self.input_ids, 0), (self.positions, 0), (self.slots, -1), (self.seq_lens, 0)):
            column += [fill] * pad
        self.query_start += range(last + 1, last + pad + 1)
        self.tables += [[]] * pad


def step_columns(plan, block_size: int) -> StepColumns:
    """The columns of a plan; tokens not sampled yet (a step planned ahead) are 0: the step takes them on the device."""
    columns = StepColumns()
    for chunk in plan:
        request, start, stop = chunk.request, chunk.start, chunk.start + chunk.length
        tokens = request.token_slice(start, stop)
        columns.input_ids += tokens + [0] * (chunk.length - len(tokens))
        columns.positions += range(start, stop)
        blocks = request.blocks
        columns.slots += [blocks[p // block_size] * block_size + p % block_size for p in range(start, stop)]
        columns.seq_lens.append(stop)
        columns.query_start.append(columns.query_start[-1] + chunk.length)
        columns.tables.append(blocks)
        if chunk.samples:
            columns.keep.append(columns.query_start[-1] - 1)
            columns.samplers.append(request)
            columns.sample_positions.append(stop - len(request.prompt))
            columns.sampler_rows.append(len(columns.seq_lens) - 1)
    return columns
