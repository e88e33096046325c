"""What a step returns: its sampled tokens, read from the device when the driver asks for them."""

from __future__ import annotations

import time

import torch


class StepOutput:
    """A launched step; `result()` waits for it: (the requests that sampled, their tokens, their logprobs). path:
    "eager", "compiled" or "replay"; kind: its sampler; ahead: it continues a step not read when it was launched."""

    keeps_tokens_on_device = False

    def __init__(self, plan, path: str, kind, ahead: bool = False):
        self.plan, self.path, self.kind, self.ahead = plan, path, kind, ahead
        self.started_at = self.read_at = None       # perf_counter() when execute() began and when result() read

    def result(self):
        tokens, logprobs = self.read()
        self.read_at = time.perf_counter()
        return [chunk.request for chunk in self.plan if chunk.samples], tokens, logprobs

    def read(self) -> tuple[list[int], list[float]]:
        raise NotImplementedError


class EagerOutput(StepOutput):
    """A step run uncaptured: its tokens and logprobs are device tensors, read with one copy."""

    def __init__(self, plan, path: str, kind, tokens: torch.Tensor, logprobs: torch.Tensor):
        super().__init__(plan, path, kind)
        self.tokens, self.logprobs = tokens, logprobs

    def read(self) -> tuple[list[int], list[float]]:
        host = torch.stack([self.tokens.double(), self.logprobs.double()]).tolist()
        return [int(t) for t in host[0]], host[1]
