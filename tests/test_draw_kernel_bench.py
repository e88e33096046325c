"""The draw benchmark's check on the CPU (Triton interpreter): both of its variants, one program a row and rows split
across programs, draw torch's tokens on rows wider than a split; a variant that differed would fail the check."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from benchmarks import draw_kernel  # noqa: E402
from cb_sync.sampling import draw_kernel as gumbel_kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_both_variants_draw_torchs_tokens():
    vocab = gumbel_kernel.SPLIT_COLUMNS + 900
    assert draw_kernel.draws_agree(2, vocab, DEVICE)
    assert gumbel_kernel.SPLIT_COLUMNS == draw_kernel.VARIANTS["split"]   # the split variant: the default


def test_a_wrong_variant_fails_the_check(monkeypatch):
    monkeypatch.setattr(draw_kernel, "draw", lambda scores, *_: scores.argmin(dim=-1))
    assert not draw_kernel.draws_agree(2, 300, DEVICE)
