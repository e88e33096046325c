"""The inputs a captured decode step reads: typed views of one device buffer, written from a host mirror
(pinned on CUDA) and sent with one copy per step instead of one per field."""

from __future__ import annotations

import math

import torch

SCALAR_FIELDS = (("input_ids", torch.int64), ("positions", torch.int64), ("slots", torch.int64),
                 ("seeds", torch.int64), ("sample_positions", torch.int64), ("top_k", torch.int64),
                 ("temperature", torch.float32), ("top_p", torch.float32), ("min_p", torch.float32),
                 ("seq_lens", torch.int32), ("do_sample", torch.bool))
ALIGN = 16     # bytes: every field starts where vectorised loads may assume alignment


class StepInputs:
    """`views[name]` (device tensors the graph reads) and `host[name]` (numpy arrays to fill) for every
    SCALAR_FIELDS name, shape [rows], and "tables", int32 [rows, width]; upload() copies the host buffer over.

    There are two host buffers, used in turn: a step's buffer may still wait for its copy while the next step's
    inputs are written (a step launched before the previous one's tokens are read)."""

    def __init__(self, rows: int, width: int, device: torch.device):
        shapes = [(name, dtype, (rows,)) for name, dtype in SCALAR_FIELDS] + [("tables", torch.int32, (rows, width))]
        offsets, size = [], 0
        for _, dtype, shape in shapes:
            offsets.append(size)
            size += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
        self.device_bytes = torch.zeros(size, dtype=torch.uint8, device=device)
        self.host_buffers = [torch.zeros(size, dtype=torch.uint8, pin_memory=device.type == "cuda") for _ in range(2)]
        self.views, self.hosts = {}, [{}, {}]
        for (name, dtype, shape), offset in zip(shapes, offsets):
            span = slice(offset, offset + math.prod(shape) * dtype.itemsize)
            self.views[name] = self.device_bytes[span].view(dtype).view(shape)
            for host, buffer in zip(self.hosts, self.host_buffers):
                host[name] = buffer[span].view(dtype).view(shape).numpy()
        self.turn = 0

    @property
    def host(self) -> dict:
        """The host buffer to fill for the next upload."""
        return self.hosts[self.turn]

    def upload(self) -> None:
        """Send the host buffer to the device (asynchronous from pinned memory) and turn to the other one: a
        buffer is filled again only two uploads later, after the step that read it has been waited for."""
        self.device_bytes.copy_(self.host_buffers[self.turn], non_blocking=True)
        self.turn ^= 1
