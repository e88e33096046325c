"""ModelRunner: turns a step plan into flat model inputs and attention metadata, runs the model, samples."""

from __future__ import annotations

from types import ModuleType

import torch

from .attention import AttnMetadata
from .cache import PagedKVCache
from .request import Request
from .graphs import is_pure_decode
from .graphs.decode_graphs import DecodeGraphs
from .graphs.step_inputs import ALIGN
from .sampling import sample_exactly, sampling_batch
from .scheduler import ScheduledChunk


class ModelRunner:
    """Runs one step of the flat batch through the model (attention comes from the registered backend): replayed
    graphs for pure decode, else the compiled decode step's function or the model's eager forward."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, backend: ModuleType, device: torch.device,
                 graphs: DecodeGraphs | None = None):
        self.model = model
        self.cache = cache
        self.backend = backend
        self.device = device
        self.graphs = graphs

    def step(self, plan: list[ScheduledChunk]) -> tuple[list[Request], list[int], list[float]]:
        """Run the plan uncaptured (through the compiled decode step where the graphs compile it); return the
        requests that sampled, their new tokens and those tokens' logprobs. (Plans that `replays` are launched and
        collected instead.)"""
        num_tokens = sum(chunk.length for chunk in plan)
        compiled = self.graphs is not None and self.graphs.runs_steps(num_tokens)
        inputs, meta, keep, samplers = self.prepare(plan, self.graphs.width if compiled else None)
        logits = self.graphs.logits(inputs["input_ids"], inputs["position_ids"], meta, keep) if compiled else None
        if logits is None:     # not compiled (or the compile failed: the padded batch runs as it is)
            logits = self.model(**inputs, cb_meta=meta, logits_to_keep=keep, use_cache=False).logits[0]
        if not samplers:
            return [], [], []
        tokens, logprobs = sample_exactly(logits[:len(samplers)], sampling_batch(samplers, self.device))
        host = torch.stack([tokens.double(), logprobs.double()]).tolist()
        return samplers, [int(t) for t in host[0]], host[1]

    def replays(self, plan: list[ScheduledChunk]) -> bool:
        """Whether this plan replays a captured decode graph (pure decode, within the largest bucket)."""
        return self.graphs is not None and len(plan) <= self.graphs.max_batch and is_pure_decode(plan)

    def launch(self, plan: list[ScheduledChunk], ahead: bool = False):
        """Replay a pure-decode plan without waiting for it (ahead: the plan after the one just launched)."""
        return self.graphs.launch([chunk.request for chunk in plan], ahead)

    def collect(self, plan: list[ScheduledChunk], launched) -> tuple[list[Request], list[int], list[float]]:
        """Wait for a launched plan: its requests, their new tokens and those tokens' logprobs."""
        requests = [chunk.request for chunk in plan]
        return requests, *self.graphs.collect(launched, requests)

    def prepare(self, plan: list[ScheduledChunk], table_width: int | None = None):
        """Flat input_ids/position_ids [1, T], attention metadata, the rows to keep logits of and the requests that
        sample from them.

        table_width: the compiled step's shape rules: block tables that wide, at least two requests (a padded one:
        one query, nothing cached, nothing stored) and two rows kept (the last one repeated)."""
        block_size = self.cache.block_size
        ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
        keep, samplers = [], []
        for chunk in plan:
            request, stop = chunk.request, chunk.start + chunk.length
            ids += request.token_slice(chunk.start, stop)
            positions += range(chunk.start, stop)
            blocks = request.blocks
            slots += [blocks[p // block_size] * block_size + p % block_size for p in range(chunk.start, stop)]
            seq_lens.append(stop)
            starts.append(starts[-1] + chunk.length)
            if chunk.samples:
                keep.append(starts[-1] - 1)
                samplers.append(request)
        tables = [chunk.request.blocks for chunk in plan]
        if table_width is not None:
            if len(plan) < 2:
                ids, positions, slots = ids + [0], positions + [0], slots + [-1]
                seq_lens, starts, tables = seq_lens + [0], starts + [starts[-1] + 1], tables + [[]]
            keep += (keep[-1:] or [0]) * (2 - len(keep))
        width = table_width or max(len(blocks) for blocks in tables)
        max_query_len, max_seq_len = max(chunk.length for chunk in plan), max(seq_lens)
        assert all(len(blocks) <= width for blocks in tables), "a block table wider than the compiled step's"
        device = self.device
        ids, positions, slots = _packed([ids, positions, slots], torch.int64, device)
        starts, seq_lens, tables = _packed([starts, seq_lens, [b for blocks in tables
                                                               for b in blocks + [0] * (width - len(blocks))]],
                                           torch.int32, device)
        meta = AttnMetadata(slot_mapping=slots, block_tables=tables.view(-1, width), seq_lens=seq_lens,
                            query_start_loc=starts, max_query_len=max_query_len, max_seq_len=max_seq_len,
                            k_caches=self.cache.k_caches, v_caches=self.cache.v_caches, backend=self.backend)
        inputs = {"input_ids": ids.unsqueeze(0), "position_ids": positions.unsqueeze(0)}
        return inputs, meta, torch.tensor(keep, dtype=torch.int64).to(device), samplers


def _packed(columns: list[list[int]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """The columns as views of one tensor sent with one copy, each starting at an ALIGN-byte boundary, as the
    decode step's static inputs do (so that a compiled step sees storage offsets of the same kind in both)."""
    align = ALIGN // dtype.itemsize
    flat, offsets = [], []
    for column in columns:
        offsets.append(len(flat))
        flat += column + [0] * (-len(column) % align)
    flat = torch.tensor(flat, dtype=dtype).to(device, non_blocking=True)
    return [flat[offset:offset + len(column)] for column, offset in zip(columns, offsets)]
