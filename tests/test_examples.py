"""The runnable examples (the README's own code blocks run in test_docs.py)."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_tiny.py"


def test_grpo_tiny_example_trains_on_cb_sync(tmp_path):
    spec = importlib.util.spec_from_file_location("grpo_tiny", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", module="cb_sync")           # e.g. compile ignored off the GPU
        trainer = example.train(output_dir=str(tmp_path), steps=1)
    assert trainer.state.global_step == 1
    driver = trainer.cb_generation.driver
    assert driver is not None and driver.model is trainer.model
    assert [entry["grad_norm"] > 0 for entry in trainer.state.log_history if "grad_norm" in entry] == [True]
