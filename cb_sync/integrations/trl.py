"""TRL integration: CBSyncGRPOTrainer, a `trl.GRPOTrainer` whose rollouts come from cb_sync.

Rollouts come from the very modules being trained: one persistent `SyncCBDriver` runs on
`accelerator.unwrap_model(model)` (a PeftModel under `peft_config=` or when one is passed). The trainer overrides
`_generate_single_turn` (also used by TRL's multi-turn tool loop); everything else is TRL's own code.

Sampling follows GRPOConfig (`temperature`, `top_p`, `top_k`, `min_p`, `max_completion_length`, `generation_kwargs`) as
read from the GenerationConfig TRL builds for its transformers path; options cb_sync cannot honour (e.g.
`repetition_penalty != 1`) raise ValueError at construction. EOS is TRL's `eos_token_ids`. TRL hands over each prompt
repeated `num_generations` times; each copy is a request with its own fresh seed, so a group's members differ, and their
identical prompts share KV blocks. The driver runs the rollout in eval + inference mode and restores every module's
training flag; the KV cache is released after each rollout unless `release_after_rollout=False`.

The generator's per-token logprobs (of the sampled token under log_softmax(logits / temperature), what the trainer
recomputes) reach TRL as `sampling_per_token_logps`. Each step logs `sampling/sampling_logp_difference/{mean,max}`,
|generator - trainer| over completion tokens (one no-grad forward when TRL computes no old logps itself;
`log_logprob_diff=False` skips it). `importance_sampling_correction=True` runs TRL's importance-sampling correction on
these logprobs (configured by GRPOConfig's `vllm_importance_sampling_*` fields), which TRL gates on `use_vllm`: the
flags are set for the duration of `_generate_and_score_completions` and `_compute_loss` only (no vLLM object is made or
reached, and the weight-sync counter is kept current).

Several processes (accelerate, DDP): every rank keeps its own driver on its own replica and generates its own slice of
the prompts; TRL seeds each process differently, so ranks do not duplicate samples; nothing is gathered for generation.
ZeRO-3 and FSDP shard parameters, so a rank does not hold the weights the driver (and its graphs) would run on: the
trainer refuses them with a ValueError. Use DDP or ZeRO-1/2, or TRL's vLLM backend."""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager

import torch
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context

from ..config import CBConfig
from ..driver import SyncCBDriver
from .transformers import sampling_params_from_generation_config

__all__ = ["CBSyncGRPOTrainer"]


class CBSyncGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` with cb_sync rollouts. Takes GRPOTrainer's arguments, plus (keyword-only):

    cb_config: engine settings of the driver (CBConfig()).
    release_after_rollout: free the KV cache after every rollout so the training step gets the memory (True).
    importance_sampling_correction: apply TRL's importance-sampling correction with the generator's logprobs (False;
        the generator runs the trained weights, so the ratio is close to 1 up to kernel numerics).
    log_logprob_diff: log mean/max |generator - trainer| logprob per step (True)."""

    def __init__(self, *args, cb_config: CBConfig | None = None, release_after_rollout: bool = True,
                 importance_sampling_correction: bool = False, log_logprob_diff: bool = True, **kwargs):
        if cb_config is not None and not isinstance(cb_config, CBConfig):
            raise ValueError(f"cb_config must be a CBConfig, got {type(cb_config).__name__}")
        grpo_args = inspect.signature(GRPOTrainer.__init__).bind(None, *args, **kwargs).arguments.get("args")
        if grpo_args is not None and (grpo_args.use_vllm or grpo_args.use_transformers_continuous_batching):
            raise ValueError("CBSyncGRPOTrainer generates with cb_sync: set use_vllm=False and "
                             "use_transformers_continuous_batching=False in GRPOConfig")
        super().__init__(*args, **kwargs)
        self.cb_config = cb_config if cb_config is not None else CBConfig()
        self.release_after_rollout = release_after_rollout
        self.importance_sampling_correction = importance_sampling_correction
        self.log_logprob_diff = log_logprob_diff
        self._cb_driver: SyncCBDriver | None = None
        self._cb_driver_key = None
        if self._dist.is_zero3 or self._dist.is_fsdp:
            raise ValueError("CBSyncGRPOTrainer does not support ZeRO-3 or FSDP: parameters are sharded, so a rank "
                             "cannot generate from the modules it trains. Use DDP or ZeRO stage 1/2.")
        if getattr(self, "_is_vlm", False):
            raise ValueError("CBSyncGRPOTrainer supports text-only models; use TRL's vLLM backend for VLMs")
        if (importance_sampling_correction and self.loss_type == "vespo"
                and self.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")):
            raise ValueError("VESPO loss requires vllm_importance_sampling_mode 'token_truncate' or 'token_mask', "
                             f"got {self.vllm_importance_sampling_mode!r}")
        # TRL's GenerationConfig for its transformers path already merges GRPOConfig and generation_kwargs.
        model = self.accelerator.unwrap_model(self.model)
        overrides = {"eos_token_id": list(self.eos_token_ids)}
        if self.max_completion_length is not None:
            overrides["max_new_tokens"] = self.max_completion_length
        self._cb_params = sampling_params_from_generation_config(model, self.generation_config, logprobs=True,
                                                                 **overrides)[0]

    @property
    def cb_driver(self) -> SyncCBDriver:
        """The persistent driver on the unwrapped model (rebuilt only if that object changes; it follows moves)."""
        model = self.accelerator.unwrap_model(self.model_wrapped)
        if self._cb_driver is None or self._cb_driver_key != id(model):
            if self._cb_driver is not None:
                self._cb_driver.release()
            self._cb_driver, self._cb_driver_key = SyncCBDriver(model, self.cb_config), id(model)
        return self._cb_driver

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Generate one completion per prompt (TRL passes each prompt already repeated num_generations times).
        Returns (completion_ids, logprobs): lists aligned with prompt_ids; completions end with EOS when it was hit."""
        if images is not None or has_tool_images or any(k.startswith("pixel_values") for k in multimodal_fields):
            raise NotImplementedError("CBSyncGRPOTrainer generates from text prompts only")
        driver = self.cb_driver
        with profiling_context(self, "cb_sync.generate"):
            results = driver.generate(prompt_ids, self._cb_params, progress_bar=bool(self.cb_config.progress_bar))
        return [r.token_ids for r in results], [r.logprobs for r in results]

    def _generate(self, prompts: list):
        try:
            return super()._generate(prompts)
        finally:
            if self.release_after_rollout and self._cb_driver is not None:
                self._cb_driver.release()

    @contextmanager
    def _importance_sampling_flags(self):
        """Switch on TRL's importance-sampling correction, which TRL gates on use_vllm, for one call."""
        if not self.importance_sampling_correction:
            yield
            return
        saved = self.use_vllm, self.vllm_importance_sampling_correction, self.vllm_mode
        self.use_vllm, self.vllm_importance_sampling_correction, self.vllm_mode = True, True, "server"
        self._last_loaded_step = self.state.global_step  # TRL would otherwise try to sync vLLM weights
        try:
            yield
        finally:
            self.use_vllm, self.vllm_importance_sampling_correction, self.vllm_mode = saved

    def _generate_and_score_completions(self, inputs):
        with self._importance_sampling_flags():
            output = super()._generate_and_score_completions(inputs)
        # With the correction on, TRL itself logs the same metrics from its old logps.
        if self.log_logprob_diff and not self.importance_sampling_correction and "sampling_per_token_logps" in output:
            self._log_logprob_difference(output)
        return output

    def _compute_loss(self, model, inputs):
        with self._importance_sampling_flags():
            return super()._compute_loss(model, inputs)

    def _log_logprob_difference(self, output: dict) -> None:
        """Log mean and max |generator logprob - trainer logprob| over the completion tokens of this rollout."""
        from trl.models.utils import disable_gradient_checkpointing
        mode = "train" if self.model.training else "eval"
        completion_mask = output["completion_mask"]
        trainer_logps = output.get("old_per_token_logps")
        if trainer_logps is None:
            ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention_mask = torch.cat([output["prompt_mask"], completion_mask], dim=1)
            batch_size = (self.args.per_device_train_batch_size if mode == "train"
                          else self.args.per_device_eval_batch_size)
            with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                trainer_logps, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, ids, attention_mask, output["completion_ids"].size(1), batch_size=batch_size)
        mask = completion_mask if "tool_mask" not in output else completion_mask * output["tool_mask"]
        delta = (trainer_logps.float() - output["sampling_per_token_logps"].float()).abs()
        delta = delta[mask.bool() & ~torch.isnan(delta)]
        delta = delta if delta.numel() else delta.new_zeros(1)       # a rank without completion tokens adds 0
        device = self.accelerator.device
        mean = self.accelerator.gather(delta.mean().to(device).reshape(1)).mean().item()
        peak = self.accelerator.gather(delta.max().to(device).reshape(1)).max().item()
        if math.isfinite(mean):
            self._metrics[mode]["sampling/sampling_logp_difference/mean"].append(mean)
            self._metrics[mode]["sampling/sampling_logp_difference/max"].append(peak)
