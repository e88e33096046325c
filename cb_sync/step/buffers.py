"""One step's inputs on the device: the plan's columns (`scheduler.plan.step_columns`) sent in one copy as typed views
of one byte buffer: buffers of the step's own size for eager steps, the static ones for replayed steps."""

from __future__ import annotations

import math

import torch

from ..attention import AttnMetadata
from ..sampling.penalties import (PENALTY_COLUMNS, PENALTY_PADDING, PenaltyBatch, PenaltyKind, TokenHistory,
                                  penalty_columns)
from ..sampling.sampler import SAMPLING_COLUMNS, SamplerKind, SamplingBatch, sampling_columns
from ..scheduler.plan import StepColumns

ALIGN = 16     # bytes: every field starts where vectorised loads may assume alignment
_TOKEN_FIELDS = ("input_ids", "positions", "slots")          # one entry a token of the step
_ROW_FIELDS = (*_TOKEN_FIELDS, "seq_lens", "query_start", "keep")


class StepBuffers:
    """Device views `views[name]` of one byte buffer, fields at ALIGN-byte boundaries, and host mirrors (numpy) that
    `upload()` sends in one copy: input_ids, positions, slots [tokens]; seq_lens [requests]; query_start [requests +
    1]; tables [requests, width]; keep [rows kept]; "sampling.<column>" [rows]; with penalties (a PenaltyKind),
    "penalty.<column>" [rows] and "penalty.banned" [rows, banned_width]. With mirrors=2 (the replay's; pinned on
    CUDA) they are used in turn: one is filled again two uploads later, once the step that read it has been waited
    for."""

    def __init__(self, tokens: int, requests: int, width: int, kept: int, sampled: int, device: torch.device,
                 mirrors: int = 1, penalties: PenaltyKind | None = None):
        shapes = [(name, torch.int64, (tokens,)) for name in _TOKEN_FIELDS]
        shapes += [("seq_lens", torch.int32, (requests,)), ("query_start", torch.int32, (requests + 1,)),
                   ("tables", torch.int32, (requests, width)), ("keep", torch.int64, (kept,))]
        shapes += [("sampling." + name, dtype, (sampled,)) for name, dtype in SAMPLING_COLUMNS.items()]
        if penalties is not None:
            shapes += [("penalty." + name, dtype, (sampled,)) for name, dtype in PENALTY_COLUMNS.items()]
            shapes.append(("penalty.banned", torch.int64, (sampled, penalties.banned_width)))
        self.penalties = penalties
        offsets, size = [], 0
        for _, dtype, shape in shapes:
            offsets.append(size)
            size += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
        pinned, allocate = mirrors > 1 and device.type == "cuda", torch.zeros if mirrors > 1 else torch.empty
        self.device_bytes = torch.empty(size, dtype=torch.uint8, device=device)
        self.host_bytes = [allocate(size, dtype=torch.uint8, pin_memory=pinned) for _ in range(mirrors)]
        self.views, self.hosts = {}, [{} for _ in range(mirrors)]
        for (name, dtype, shape), offset in zip(shapes, offsets):
            span = slice(offset, offset + math.prod(shape) * dtype.itemsize)
            self.views[name] = self.device_bytes[span].view(dtype).view(shape)
            for host, buffer in zip(self.hosts, self.host_bytes):
                host[name] = buffer[span].view(dtype).view(shape).numpy()
        self.turn = 0

    @classmethod
    def packed(cls, columns: StepColumns, width: int, device: torch.device,
               penalties: PenaltyKind | None = None) -> StepBuffers:
        """Buffers of the columns' own sizes, written and sent to the device."""
        buffers = cls(len(columns.input_ids), len(columns.seq_lens), width, len(columns.keep),
                      len(columns.samplers), device, penalties=penalties)
        buffers.write(columns)
        buffers.upload()
        return buffers

    def write(self, columns: StepColumns) -> None:
        """Fill the current host mirror's leading rows from the columns (table rows zero-padded)."""
        host = self.hosts[self.turn]
        sampling = sampling_columns(columns.samplers, columns.sample_positions)
        for name, values in [(name, getattr(columns, name)) for name in _ROW_FIELDS] + [
                ("sampling." + name, values) for name, values in sampling.items()]:
            host[name][:len(values)] = values
        tables = host["tables"]
        tables[:len(columns.tables)] = 0
        for row, blocks in enumerate(columns.tables):
            tables[row, :len(blocks)] = blocks
        if self.penalties is not None:
            penalties = penalty_columns(columns.samplers, columns.sample_positions, columns.sampler_rows,
                                        self.penalties.banned_width)
            for name, values in penalties.items():
                column = host["penalty." + name]
                column[len(values):] = PENALTY_PADDING[name]
                if values:
                    column[:len(values)] = values

    def upload(self) -> None:
        """Send the current host mirror to the device and turn to the next one."""
        self.device_bytes.copy_(self.host_bytes[self.turn], non_blocking=True)
        self.turn = (self.turn + 1) % len(self.host_bytes)

    def model_inputs(self, tokens: int, requests: int, kept: int, cache, backend, tuning, max_query_len: int,
                     max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata, torch.Tensor]:
        """Token ids and positions [1, tokens], the attention metadata and the rows kept, of the leading rows."""
        v = self.views
        meta = AttnMetadata(v["slots"][:tokens], v["tables"][:requests], v["seq_lens"][:requests],
                            v["query_start"][:requests + 1], max_query_len, max_seq_len, cache.k_caches,
                            cache.v_caches, backend, tuning, cache.pool_offsets)
        return v["input_ids"][:tokens].unsqueeze(0), v["positions"][:tokens].unsqueeze(0), meta, v["keep"][:kept]

    def record_tokens(self, history: TokenHistory, tokens: int) -> None:
        """Store the leading tokens at their cache slots in `history`, where the step's penalties read them."""
        if self.penalties is not None and self.penalties.reads_history:
            history.record(self.views["slots"][:tokens], self.views["input_ids"][:tokens])

    def sampling(self, rows: int, kind: SamplerKind, history: TokenHistory | None = None) -> SamplingBatch:
        """The sampling parameters of the leading rows, with their penalties' where the buffers have them."""
        v, penalties = self.views, None
        if self.penalties is not None:
            penalties = PenaltyBatch(self.penalties, *(v["penalty." + name][:rows] for name in PENALTY_COLUMNS),
                                     v["penalty.banned"][:rows], v["tables"], history)
        return SamplingBatch(*(v["sampling." + name][:rows] for name in SAMPLING_COLUMNS), kind=kind,
                             penalties=penalties)
