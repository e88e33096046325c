"""The private names of TRL's GRPOTrainer this integration relies on, in one place: the hooks the trainer overrides,
the attributes it reads or writes, and the public flags `importance_sampling` sets to steer TRL's branches. A TRL
release may rename or drop any of them; `missing()` names those the installed TRL lacks (a test runs it)."""

from __future__ import annotations

import inspect
import re

HOOKS = ("_generate_single_turn", "_generate", "_prepare_inputs", "_generate_and_score_completions", "_compute_loss",
         "_get_per_token_logps_and_entropies")
ATTRIBUTES = ("_dist", "_is_vlm", "_buffered_inputs", "_step", "_entropy_bonus_enabled", "_tokenizer", "_metrics",
              "_last_loaded_step")
STEERING_FLAGS = ("use_vllm", "vllm_mode", "vllm_importance_sampling_correction")


def trl_source() -> str:
    """The source of GRPOTrainer and its bases from TRL and transformers, where their attributes are assigned."""
    from trl import GRPOTrainer
    return "".join(inspect.getsource(cls) for cls in GRPOTrainer.__mro__
                   if cls.__module__.startswith(("trl.", "transformers.")))


def missing() -> list[str]:
    """The names above that the installed TRL's GRPOTrainer no longer has: a hook it does not define, an attribute
    its code (or its bases') never assigns."""
    from trl import GRPOTrainer
    source = trl_source()
    return ([name for name in HOOKS if not callable(getattr(GRPOTrainer, name, None))]
            + [name for name in ATTRIBUTES + STEERING_FLAGS if not re.search(rf"\bself\.{name}\s*=", source)])
