"""The generator-vs-trainer logprob gap, logged by CBSyncGRPOTrainer.

The generator's logprob of each completion token (`sampling_per_token_logps`) against the trainer's of the same token:
TRL's old logps where it computes them, else the logprobs of the loss's own forward (the same weights, so no extra
forward). Each log gets `sampling/sampling_logp_difference/{mean,p95,max}` of |trainer - generator| and
`sampling/ratio_outside_0.9_1.1`, the share of tokens whose ratio p_trainer / p_generator lies outside [0.9, 1.1],
over every rank's completion tokens since the last log."""

from __future__ import annotations

import contextlib
import math

import torch


class LogprobGap:
    """trainer - generator logprobs of completion tokens, gathered over ranks and kept per mode ("train" or "eval")
    until the next log.

    Args:
        accelerator: the trainer's `accelerate.Accelerator` (its device, and the gather over ranks).
    """

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.deltas: dict[str, list[torch.Tensor]] = {}
        self._awaited: tuple[dict, str] | None = None     # a loss's batch, until its forward's logprobs come

    def add(self, trainer_logps: torch.Tensor, batch: dict, mode: str) -> None:
        """Keep trainer_logps - the generator's over the batch's completion tokens (its completion_mask, and its
        tool_mask where it has one), gathered over ranks.

        Args:
            trainer_logps: [B, T] the trainer's logprobs of the batch's completion tokens.
            batch: TRL's batch: `completion_mask`, `sampling_per_token_logps` and maybe `tool_mask`.
            mode: "train" or "eval".
        """
        mask = batch["completion_mask"] if "tool_mask" not in batch else batch["completion_mask"] * batch["tool_mask"]
        delta = trainer_logps.float() - batch["sampling_per_token_logps"].float()
        delta = delta[mask.bool() & ~torch.isnan(delta)].to(self.accelerator.device)
        # ranks hold different token counts: pad with NaN to the longest, gather, drop the padding
        delta = self.accelerator.gather(self.accelerator.pad_across_processes(delta, pad_index=math.nan))
        self.deltas.setdefault(mode, []).append(delta[~torch.isnan(delta)])

    @contextlib.contextmanager
    def from_next_forward(self, batch: dict | None, mode: str):
        """A block (one loss) whose next logprob forward scores `batch` (None: none): `forward_done` adds that
        forward's logprobs. TRL's loss does not return its logprobs, so they are taken as they pass."""
        self._awaited = None if batch is None else (batch, mode)
        try:
            yield
        finally:
            self._awaited = None

    def forward_done(self, trainer_logps: torch.Tensor) -> None:
        """Call with every logprob forward's logprobs: the first within `from_next_forward` is added."""
        awaited, self._awaited = self._awaited, None
        if awaited is not None:
            self.add(trainer_logps.detach(), *awaited)

    def metrics(self, mode: str) -> dict[str, float]:
        """The gap's statistics since the last call for `mode` ({} where no token came), the deltas dropped."""
        deltas = self.deltas.pop(mode, [])
        delta = torch.cat(deltas) if deltas else torch.empty(0)
        if not delta.numel():
            return {}
        gap = delta.abs()
        outside = (delta > math.log(1.1)) | (delta < math.log(0.9))
        return {"sampling/sampling_logp_difference/mean": gap.mean().item(),
                "sampling/sampling_logp_difference/p95": quantile(gap, 0.95),
                "sampling/sampling_logp_difference/max": gap.max().item(),
                "sampling/ratio_outside_0.9_1.1": outside.float().mean().item()}


def quantile(values: torch.Tensor, q: float) -> float:
    """torch.quantile's (linear interpolation) of a 1-D tensor of any size: torch.quantile refuses over 2**24 values,
    which a run's gathered completion tokens reach."""
    ordered = values.sort().values
    position = q * (ordered.numel() - 1)
    below = int(position)
    above = min(below + 1, ordered.numel() - 1)
    return torch.lerp(ordered[below], ordered[above], position - below).item()
