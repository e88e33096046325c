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
    SCALAR_FIELDS name, shape [rows], and "tables", int32 [rows, width]; upload() copies the host buffer over."""

    def __init__(self, rows: int, width: int, device: torch.device):
        shapes = [(name, dtype, (rows,)) for name, dtype in SCALAR_FIELDS] + [("tables", torch.int32, (rows, width))]
        offsets, size = [], 0
        for _, dtype, shape in shapes:
            offsets.append(size)
            size += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
        self.device_bytes = torch.zeros(size, dtype=torch.uint8, device=device)
        self.host_bytes = torch.zeros(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.views, self.host = {}, {}
        for (name, dtype, shape), offset in zip(shapes, offsets):
            span = slice(offset, offset + math.prod(shape) * dtype.itemsize)
            self.views[name] = self.device_bytes[span].view(dtype).view(shape)
            self.host[name] = self.host_bytes[span].view(dtype).view(shape).numpy()

    def upload(self) -> None:
        """Send the host buffer to the device (asynchronous from pinned memory: fill the host side again only
        after the step that reads it has run)."""
        self.device_bytes.copy_(self.host_bytes, non_blocking=True)
