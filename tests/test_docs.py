"""What the docs promise: the README's code runs as written, its install commands are CI's, the public docstrings name
every field (and SamplingParams' defaults), links lead to files, and the README stays a short page for users."""

from __future__ import annotations

import configparser
import dataclasses
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from cb_sync import CBConfig, GenerationResult, SamplingParams
from cb_sync.cli import tiny_model
from cb_sync.integrations import transformers as cb_transformers

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
USER_DOCS = [README] + [ROOT / "docs" / f"{name}.md" for name in
                        ("architecture", "trl", "batch_invariant", "long_rollouts", "data_parallel", "tuning",
                         "sampling")]
TEST_COMMAND = 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q'
DEMO_COMMAND = "pip install torch==2.13.0 && pip install -e . && cb-sync demo"
LAB_NOTEBOOK = re.compile(r"\b(leases?|clean clones?|attempt \d+)\b", re.I)


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def offline_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of `vocab_size` ids (<pad>, <eos>, <unk>, then w3, w4, ...), built without the Hub."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_readme_python_blocks_run_in_order(monkeypatch, tmp_path):
    """Every python block of the README, in order and in one namespace, as a reader pastes them (the TRL trainer
    included; it trains in tmp_path). Nothing is downloaded: `from_pretrained` serves the tiny random Qwen3
    (`cb_sync.cli.tiny_model`) and an offline word-level tokenizer of its vocabulary, so the text out is that
    tokenizer's words, and the rest of the code runs unchanged on the CPU."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *args, **kwargs: tiny_model())
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *args, **kwargs: offline_tokenizer(512))
    blocks = code_blocks(README.read_text(), "python")
    assert len(blocks) >= 4
    namespace = {"__name__": "readme"}
    for number, code in enumerate(blocks, 1):
        exec(compile(code, f"README.md, python block {number}", "exec"), namespace)
    assert namespace["trainer"].state.global_step > 0


def test_readme_is_a_short_page_for_users():
    readme = README.read_text()
    assert len(readme) <= 12_000, len(readme)
    for doc in USER_DOCS:
        assert not LAB_NOTEBOOK.findall(doc.read_text()), doc.name


def test_links_and_cited_result_files_lead_to_files():
    for doc in USER_DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.name}: {target}"
        for cited in re.findall(r"`(benchmarks/results/[^`]+)`", text):
            assert (ROOT / cited).exists(), f"{doc.name}: {cited}"


def test_the_architecture_file_map_lists_every_module():
    listed = set(re.findall(r"`(cb_sync/[\w/]+\.py)`", (ROOT / "docs" / "architecture.md").read_text()))
    modules = {path.relative_to(ROOT).as_posix() for path in (ROOT / "cb_sync").rglob("*.py")}
    assert listed == modules, {"not listed": sorted(modules - listed), "gone": sorted(listed - modules)}


def test_install_commands_take_everything_from_pypi_and_ci_runs_the_test_command():
    """A machine that reaches PyPI only runs the README's two commands without an error or a retry; CI runs the test
    command step by step. The CPU index is a tip in prose, outside the commands."""
    readme, ci = README.read_text(), (ROOT / ".ci" / "run").read_text()
    commands = [block.strip() for block in code_blocks(readme, "bash")]
    assert commands[:2] == [DEMO_COMMAND, TEST_COMMAND]
    assert not any("index-url" in command or "find-links" in command for command in commands)
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme
    assert "set -euo pipefail" in ci
    steps = [line.replace("python -m pip install -q ", "pip install ") for line in ci.splitlines()
             if line.startswith("python -m ")]
    assert steps == TEST_COMMAND.split(" && ")


def entries(doc: str, names: list[str]) -> dict[str, str]:
    """Each name's entry in a docstring: from the name followed by ':', '[' or '(' to the next such entry."""
    starts = {}
    for name in names:
        match = re.search(rf"\b{name}\b\s*[:\[(]", doc)
        assert match, f"{name} has no entry"
        starts[name] = match.start()
    ends = sorted(starts.values()) + [len(doc)]
    return {name: doc[start:ends[ends.index(start) + 1]] for name, start in starts.items()}


def test_sampling_params_docstring_gives_every_field_and_default():
    fields = dataclasses.fields(SamplingParams)
    found = entries(SamplingParams.__doc__, [f.name for f in fields])
    for field in fields:
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        assert repr(default) in found[field.name], (field.name, found[field.name])


def test_cb_config_and_generation_result_docstrings_give_every_field_an_entry():
    for cls in (CBConfig, GenerationResult):
        names = [field.name for field in dataclasses.fields(cls)]
        for name, entry in entries(cls.__doc__, names).items():
            assert len(entry.split(None, 1)[-1]) > 10, (cls.__name__, name)     # the entry says something


def test_public_integration_functions_have_docstrings():
    for name in ("enable", "disable", "is_enabled", "get_driver"):
        assert getattr(cb_transformers, name).__doc__, name


def test_slow_marker_is_registered_and_the_quick_subset_documented():
    ini = configparser.ConfigParser()
    ini.read(ROOT / "pytest.ini")
    assert "--strict-markers" in ini["pytest"]["addopts"]
    assert any(line.startswith("slow:") for line in ini["pytest"]["markers"].strip().splitlines())
    assert 'python -m pytest -q -m "not slow"' in README.read_text()
