"""What the docs promise: public docstrings name every field and default."""

from __future__ import annotations

import dataclasses
import re

from cb_sync import GenerationResult, SamplingParams
from cb_sync.integrations import transformers as cb_transformers


def test_sampling_params_docstring_gives_every_field_and_default():
    doc = SamplingParams.__doc__
    for field in dataclasses.fields(SamplingParams):
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        assert re.search(rf"\b{field.name}\b[^\[\n]*\[{re.escape(repr(default))}\]", doc), field.name


def test_generation_result_docstring_names_every_field():
    for field in dataclasses.fields(GenerationResult):
        assert re.search(rf"\b{field.name}\b", GenerationResult.__doc__), field.name


def test_public_integration_functions_have_docstrings():
    for name in ("enable", "disable", "is_enabled", "get_driver"):
        assert getattr(cb_transformers, name).__doc__, name
