"""What the docs promise: public docstrings name every field and default, README and CI install torch alike."""

from __future__ import annotations

import configparser
import dataclasses
import re
from pathlib import Path

from cb_sync import GenerationResult, SamplingParams
from cb_sync.integrations import transformers as cb_transformers

ROOT = Path(__file__).resolve().parents[1]


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


def test_readme_and_ci_install_torch_as_they_say():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    quick_start = readme[readme.index("## Quick start"):readme.index("## Use")]
    cpu_index = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    commands = re.findall(r"```bash\n(.*?)```", quick_start, re.S)
    assert commands and all(c.startswith(cpu_index) for c in commands)
    assert "resolves to the CUDA build" in quick_start
    assert re.search(r"^python -m pip install -q torch==2\.13\.0$", ci, re.M)     # CI reaches PyPI only
    assert "--index-url https://download.pytorch.org/whl/cpu" in ci and "CUDA build" in ci


def test_slow_marker_is_registered_and_the_quick_subset_documented():
    ini = configparser.ConfigParser()
    ini.read(ROOT / "pytest.ini")
    assert "--strict-markers" in ini["pytest"]["addopts"]
    assert any(line.startswith("slow:") for line in ini["pytest"]["markers"].strip().splitlines())
    tests = (ROOT / "README.md").read_text().split("## Tests", 1)[1]
    assert 'python -m pytest -q -m "not slow"' in tests and "2 CPU cores" in tests
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith("python -m pytest -q")     # CI runs everything
