"""TRL's private names the trainer uses: all listed in `integrations.trl.trl_names`, and all still in the installed
TRL (a TRL release that renames or removes one fails here, naming it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("trl")

from trl import GRPOTrainer  # noqa: E402

from cb_sync.integrations.trl import trl_names  # noqa: E402

PACKAGE = Path(trl_names.__file__).parent


def test_every_listed_name_is_in_the_installed_trl():
    assert trl_names.missing() == [], "TRL no longer has these names cb_sync's trainer uses"


def test_every_private_trl_name_the_integration_uses_is_listed():
    used = set()
    for path in PACKAGE.rglob("*.py"):
        used |= set(re.findall(r"\b(?:self|trainer|super\(\))\.(_[a-z]\w*)", path.read_text()))
    source = trl_names.trl_source()
    trl_own = {name for name in used if hasattr(GRPOTrainer, name) or re.search(rf"\bself\.{name}\s*=", source)}
    assert sorted(trl_own - set(trl_names.HOOKS + trl_names.ATTRIBUTES)) == []


def test_a_missing_name_is_named(monkeypatch):
    monkeypatch.setattr(trl_names, "ATTRIBUTES", trl_names.ATTRIBUTES + ("_renamed_in_a_later_release",))
    assert trl_names.missing() == ["_renamed_in_a_later_release"]
