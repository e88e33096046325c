"""What CBSyncGRPOTrainer refuses before TRL builds anything: arguments of the wrong type, options that cannot run
together, another generation backend, and sharded parameters (ZeRO-3, FSDP), under which a rank does not hold the
weights its driver (and its graphs) would run on."""

from __future__ import annotations

import inspect
import os

from transformers.integrations import is_deepspeed_zero3_enabled
from trl import GRPOTrainer

from ...config import CBConfig


def check_arguments(trl_args: tuple, trl_kwargs: dict, cb_config, release_after_rollout, importance_sampling_correction,
                    log_logprob_diff, group_by_length, compile_layers, freeze_gc) -> None:
    """ValueError for a CBSyncGRPOTrainer's arguments that cannot run (the trainer's own, and GRPOTrainer's
    `trl_args` and `trl_kwargs`), before any work."""
    if cb_config is not None and not isinstance(cb_config, CBConfig):
        raise ValueError(f"cb_config must be a CBConfig, got {type(cb_config).__name__}")
    for name, value in (("release_after_rollout", release_after_rollout), ("group_by_length", group_by_length)):
        if not (value is None or isinstance(value, bool)):
            raise ValueError(f"{name} must be True, False or None, got {value!r}")
    for name, value in (("importance_sampling_correction", importance_sampling_correction),
                        ("log_logprob_diff", log_logprob_diff), ("compile_layers", compile_layers),
                        ("freeze_gc", freeze_gc)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    if compile_layers and cb_config is not None and cb_config.batch_invariant:
        raise ValueError("compile_layers=True cannot run with CBConfig(batch_invariant=True): its forwards run "
                         "their own kernels, which compiling would change")
    grpo_args = inspect.signature(GRPOTrainer.__init__).bind(None, *trl_args, **trl_kwargs).arguments.get("args")
    if grpo_args is not None and (grpo_args.use_vllm or grpo_args.use_transformers_continuous_batching):
        raise ValueError("CBSyncGRPOTrainer generates with cb_sync: set use_vllm=False and "
                         "use_transformers_continuous_batching=False in GRPOConfig")
    refuse_sharded_parameters(is_deepspeed_zero3_enabled(), _fsdp_asked(grpo_args))


def refuse_sharded_parameters(zero3: bool, fsdp: bool) -> None:
    """ValueError under ZeRO-3 or FSDP: a rank cannot generate from modules whose parameters are sharded."""
    if zero3 or fsdp:
        raise ValueError("CBSyncGRPOTrainer does not support ZeRO-3 or FSDP: parameters are sharded, so a rank "
                         "cannot generate from the modules it trains. Use DDP or ZeRO stage 1/2.")


def _fsdp_asked(args) -> bool:
    """FSDP asked for in the arguments or by `accelerate launch` (which says so in the environment)."""
    from_launch = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true", "yes")
    return bool(getattr(args, "fsdp", None)) or from_launch
