"""Penalties and masks on a step's logits, before temperature: the repetition penalty (HF's), frequency and presence
penalties (vLLM's), and the tokens masked by min_new_tokens and suppress_tokens.

The tokens a penalty counts are read on the device, from the token id stored at every KV-cache slot
(`TokenHistory`): each step writes its input tokens at their slots, as it writes their K/V, so a step replayed from a
graph, launched before the previous step's tokens are read (it takes them on the device), launched again or redone
writes the same place again, and a request recomputed after preemption, or sharing another's prompt blocks, finds its
tokens where its block table points. The arithmetic is per row: a row's logits depend on that row alone."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_TOKEN = 2**62        # pads a row's banned ids: clamped to the spare column past the vocabulary
PENALTY_COLUMNS = {"repetition": torch.float32, "frequency": torch.float32, "presence": torch.float32,
                   "prompt_lens": torch.int64, "table_rows": torch.int64}
PENALTY_PADDING = {"repetition": 1.0, "frequency": 0.0, "presence": 0.0, "prompt_lens": 0, "table_rows": 0,
                   "banned": NO_TOKEN}       # rows of no request: neutral, and in range


@dataclass(frozen=True)
class PenaltyKind:
    """The terms a call's steps compute (a captured graph records one kind; None where no request has any):
    repetition: some request's repetition_penalty != 1; counts: some frequency or presence penalty != 0;
    banned_width: columns of banned ids per row (suppress_tokens, and EOS and stop ids under min_new_tokens)."""

    repetition: bool
    counts: bool
    banned_width: int

    @property
    def reads_history(self) -> bool:
        return self.repetition or self.counts


def penalty_kind(requests) -> PenaltyKind | None:
    """The PenaltyKind serving every request (Requests: their params and EOS ids), None where none uses any. Rows
    without a term compute it with neutral values, which leave their logits' bits as they are."""
    params = [r.params for r in requests]
    repetition = any(p.repetition_penalty != 1 for p in params)
    counts = any(p.frequency_penalty or p.presence_penalty for p in params)
    banned = max(len(banned_ids(r, 0)) for r in requests)
    if not (repetition or counts or banned):
        return None
    return PenaltyKind(repetition, counts, banned and 1 << (banned - 1).bit_length())


def banned_ids(request, position: int) -> list[int]:
    """Ids a request may not choose as its output `position`: suppress_tokens, and before min_new_tokens its EOS and
    stop ids (as vLLM's min_tokens; HF's min_new_tokens masks EOS only)."""
    params = request.params
    early = sorted(request.eos_ids | set(params.stop_token_ids)) if position < params.min_new_tokens else []
    return params.suppress_tokens + early


def penalty_columns(requests, positions: list[int], table_rows: list[int], width: int) -> dict[str, list]:
    """Host-side PenaltyBatch columns of requests sampling their outputs at `positions`, their block tables at
    `table_rows` of the step's tables; banned ids padded to `width` columns."""
    params = [r.params for r in requests]
    banned = [banned_ids(r, p) for r, p in zip(requests, positions)]
    return {"repetition": [p.repetition_penalty for p in params], "frequency": [p.frequency_penalty for p in params],
            "presence": [p.presence_penalty for p in params], "prompt_lens": [len(r.prompt) for r in requests],
            "table_rows": table_rows, "banned": [ids + [NO_TOKEN] * (width - len(ids)) for ids in banned]}


class TokenHistory:
    """The token id at every KV-cache slot, on the device (int64 [slots + 1], the last entry the place where padding
    tokens write). It grows by powers of two and outlives a release of the cache, as the graphs that read it do."""

    def __init__(self, block_size: int, device: torch.device):
        self.block_size, self.device = block_size, device
        self.ids: torch.Tensor | None = None

    def ensure(self, num_slots: int) -> None:
        if self.ids is None or len(self.ids) <= num_slots:
            self.ids = torch.zeros(1 << num_slots.bit_length(), dtype=torch.int64, device=self.device)

    def release(self) -> None:
        self.ids = None

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Store a step's input tokens at their cache slots (-1: a padding token, stored in the spare entry)."""
        self.ids[torch.where(slots < 0, len(self.ids) - 1, slots)] = token_ids

    def read(self, tables: torch.Tensor, prompt_lens: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row of block tables [S, width]: the token ids of its first width * block_size positions, whether each
        was fed before the output `positions` [S] is sampled (prompt and output so far), whether it is an output."""
        span = torch.arange(tables.shape[1] * self.block_size, device=tables.device)
        offsets = torch.arange(self.block_size, device=tables.device)
        slots = (tables.long()[:, :, None] * self.block_size + offsets).flatten(1)
        fed = span < (prompt_lens + positions)[:, None]
        return self.ids[slots], fed, fed & (span >= prompt_lens[:, None])


@dataclass
class PenaltyBatch:
    """Per-row penalty parameters for the S rows that sample this step (tensors on the logits' device), with the
    step's block tables and the token history they index."""

    kind: PenaltyKind
    repetition: torch.Tensor    # float32 [S], 1 = off
    frequency: torch.Tensor     # float32 [S], 0 = off
    presence: torch.Tensor      # float32 [S], 0 = off
    prompt_lens: torch.Tensor   # int64 [S]
    table_rows: torch.Tensor    # int64 [S], the row's request in `tables`
    banned: torch.Tensor        # int64 [S, banned_width], ids past the vocabulary ignored
    tables: torch.Tensor        # int32 [requests, width], the step's block tables
    history: TokenHistory | None


def apply_penalties(scores: torch.Tensor, batch: PenaltyBatch, positions: torch.Tensor) -> torch.Tensor:
    """The float32 logits [S, V] of rows sampling their outputs at `positions` [S], penalised in vLLM's order
    (repetition, frequency, presence) and masked (-inf where banned)."""
    kind, vocab = batch.kind, scores.shape[1]
    if kind.reads_history:
        tokens, fed, output = batch.history.read(batch.tables.index_select(0, batch.table_rows), batch.prompt_lens,
                                                 positions)
    if kind.repetition:     # HF's gather, penalise, scatter: one pass over the vocabulary
        # a position not fed yet stands for position 0 (a prompt is never empty), whose value it writes again
        index = torch.where(fed, tokens, tokens[:, :1])
        seen, penalty = scores.gather(1, index), batch.repetition[:, None]
        scores = scores.scatter(1, index, torch.where(seen < 0, seen * penalty, seen / penalty))
    if kind.counts:
        index = torch.where(output, tokens, vocab)
        counts = scores.new_zeros(len(scores), vocab + 1).scatter_add_(1, index, scores.new_ones(index.shape))
        counts = counts[:, :vocab]
        scores = scores - batch.frequency[:, None] * counts
        scores = scores - batch.presence[:, None] * (counts > 0)
    if kind.banned_width:
        scores = scores.masked_fill(_marked(batch.banned.clamp(max=vocab), vocab), float("-inf"))
    return scores


def _marked(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [S, vocab]: which ids each row of ids [S, N] holds (ids equal to vocab mark nothing)."""
    return torch.zeros(len(ids), vocab + 1, dtype=torch.bool, device=ids.device).scatter_(1, ids, True)[:, :vocab]
