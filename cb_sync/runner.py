"""ModelRunner: turns a step plan into flat model inputs and attention metadata, runs the model, samples."""

from __future__ import annotations

from types import ModuleType

import torch

from .attention import AttnMetadata
from .cache import PagedKVCache
from .request import Request
from .graphs import is_pure_decode
from .graphs.decode_graphs import DecodeGraphs
from .sampling import sample_exactly, sampling_batch
from .scheduler import ScheduledChunk


class ModelRunner:
    """Runs one step of the flat batch through the model as is (attention comes from the registered backend)."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, backend: ModuleType, device: torch.device,
                 graphs: DecodeGraphs | None = None):
        self.model = model
        self.cache = cache
        self.backend = backend
        self.device = device
        self.graphs = graphs

    def step(self, plan: list[ScheduledChunk]) -> tuple[list[Request], list[int], list[float]]:
        """Run the plan eagerly; return the requests that sampled, their new tokens and those tokens' logprobs.
        (Plans that `replays` are launched and collected instead.)"""
        inputs, meta, sample_rows, samplers = self.prepare(plan)
        logits = self.model(**inputs, cb_meta=meta, logits_to_keep=sample_rows, use_cache=False).logits[0]
        if not samplers:
            return [], [], []
        tokens, logprobs = sample_exactly(logits, sampling_batch(samplers, self.device))
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

    def prepare(self, plan: list[ScheduledChunk]):
        """Flat input_ids/position_ids [1, T], attention metadata, the rows to sample and their requests."""
        block_size = self.cache.block_size
        ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
        sample_rows, samplers = [], []
        for chunk in plan:
            request, stop = chunk.request, chunk.start + chunk.length
            ids += request.token_slice(chunk.start, stop)
            positions += range(chunk.start, stop)
            blocks = request.blocks
            slots += [blocks[p // block_size] * block_size + p % block_size for p in range(chunk.start, stop)]
            seq_lens.append(stop)
            starts.append(starts[-1] + chunk.length)
            if chunk.samples:
                sample_rows.append(starts[-1] - 1)
                samplers.append(request)
        width = max(len(chunk.request.blocks) for chunk in plan)
        tables = [chunk.request.blocks + [0] * (width - len(chunk.request.blocks)) for chunk in plan]
        device = self.device
        meta = AttnMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
            block_tables=torch.tensor(tables, dtype=torch.int32).to(device, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
            query_start_loc=torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True),
            max_query_len=max(chunk.length for chunk in plan), max_seq_len=max(seq_lens),
            k_caches=self.cache.k_caches, v_caches=self.cache.v_caches, backend=self.backend)
        inputs = {"input_ids": torch.tensor([ids]).to(device, non_blocking=True),
                  "position_ids": torch.tensor([positions]).to(device, non_blocking=True)}
        return inputs, meta, torch.tensor(sample_rows, dtype=torch.int64).to(device), samplers
