"""TRL's importance-sampling correction, switched on for cb_sync's rollouts.

TRL 1.16's GRPOTrainer applies its correction (old logps computed, the ratio to the generator's logprobs, its
truncation or mask, the loss weighted by it, its metrics logged) only where `use_vllm and
vllm_importance_sampling_correction` hold, and has no other switch for it. `vllm_importance_sampling` sets those flags
on the trainer for one call of TRL's and restores them after, so no vLLM object is ever made or reached:
`vllm_mode="server"` keeps TRL's tool loop off the colocated engine's length limit, and `_last_loaded_step` is kept
current so that a `rollout_func` never asks for a weight sync. Outside these calls the trainer is TRL's non-vLLM
trainer, as it is built. No override serves instead: TRL tests these flags inline in the very methods that must run
(`_generate_and_score_completions`, `_compute_loss`), not in a hook of their own (`trl_names` lists them)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def vllm_importance_sampling(trainer, on: bool):
    """A block within which TRL's `trainer` applies its vLLM importance-sampling correction (on), configured by
    GRPOConfig's `vllm_importance_sampling_*` fields, to the generator's logprobs; nothing changes where on is False.

    Args:
        trainer: a `trl.GRPOTrainer`.
        on: whether to apply the correction.
    """
    if not on:
        yield
        return
    saved = trainer.use_vllm, trainer.vllm_importance_sampling_correction, trainer.vllm_mode
    trainer.use_vllm, trainer.vllm_importance_sampling_correction, trainer.vllm_mode = True, True, "server"
    trainer._last_loaded_step = trainer.state.global_step
    try:
        yield
    finally:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction, trainer.vllm_mode = saved
