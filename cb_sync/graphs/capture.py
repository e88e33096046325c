"""CUDA graphs captured and replayed by key, in one memory pool, and the fingerprint of what they recorded about a
model (dropped whenever it changes)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def model_fingerprint(modules: list[torch.nn.Module]) -> tuple:
    """What a captured graph bakes in about a model's modules: parameter and buffer storages and dtypes, adapter state
    (active, merged, disabled adapters and their scalings, which a graph holds as constants)."""
    tensors = tuple((t.data_ptr(), t.dtype) for m in modules
                    for t in (*m._parameters.values(), *m._buffers.values()) if t is not None)
    # PEFT's tuner layers, told by a class attribute (no __getattr__ miss)
    tuners = [(i, m) for i, m in enumerate(modules) if hasattr(type(m), "merged_adapters")]
    adapters = tuple((i, repr(getattr(m, "active_adapters", None)), repr(m.merged_adapters),
                      getattr(m, "disable_adapters", None), repr(getattr(m, "scaling", None))) for i, m in tuners)
    return tensors, adapters


class DecodeGraphs:
    """`capture(key, step)` records step() in a CUDA graph, `replay(key)` replays it. Off CUDA nothing is captured:
    replay runs the step itself (so the static-buffer path runs, and is tested, on the CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.graphs: dict[tuple, Callable[[], None]] = {}
        self.pool = None
        self.fingerprint = None

    def __contains__(self, key: tuple) -> bool:
        return key in self.graphs

    def keep_if(self, fingerprint) -> None:
        """Keep the graphs only if they were captured under this fingerprint (of what they recorded)."""
        if fingerprint != self.fingerprint:
            self.release()
        self.fingerprint = fingerprint

    def capture(self, key: tuple, step: Callable[[], None]) -> None:
        if self.device.type != "cuda":
            self.graphs[key] = step
            return
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            step()
        torch.cuda.synchronize()
        self.graphs[key] = graph.replay

    def replay(self, key: tuple) -> None:
        self.graphs[key]()

    def release(self) -> None:
        """Free every captured graph and its memory pool."""
        self.graphs.clear()
        self.pool = None
