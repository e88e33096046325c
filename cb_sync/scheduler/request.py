"""Per-request state: tokens so far, KV blocks held, sampling seed, and how it finished."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ..config import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    """One prompt in the engine; num_computed: its leading tokens whose K/V is cached (the next step feeds the rest)."""

    index: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    eos_ids: frozenset[int]
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def max_positions(self) -> int:
        """The most positions it feeds, and so holds in the KV cache: its last token is never fed back."""
        return len(self.prompt) + self.params.max_new_tokens - 1

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output."""
        plen = len(self.prompt)
        if stop <= plen:
            return self.prompt[start:stop]
        return (self.prompt[start:] if start < plen else []) + self.output[max(start - plen, 0):stop - plen]

    def append(self, token: int, logprob: float | None) -> None:
        """Add a sampled token and decide whether the request is done."""
        self.output.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if token in self.eos_ids:
            self.finish_reason = "eos"
        elif token in self.params.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.output) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            self.status = Status.FINISHED


@dataclass
class GenerationResult:
    """What generate() returns for one prompt, in input order.

    Args:
        request_id: the prompt's index in the call.
        prompt_ids: the prompt's token ids.
        token_ids: the generated tokens only, the EOS or stop token included.
        logprobs: one per generated token with `SamplingParams(logprobs=True)`, else None.
        finish_reason: "eos" | "stop" | "length".
        seed: the request's sampling seed, its own or the one drawn for it: `SamplingParams(seed=seed)` draws the
            same sampling noise again.
    """

    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    seed: int

    @classmethod
    def of(cls, request: Request) -> GenerationResult:
        return cls(request.index, request.prompt, request.output,
                   request.logprobs if request.params.logprobs else None, request.finish_reason, request.seed)
