"""CBSyncGRPOTrainer: a `trl.GRPOTrainer` whose rollouts come from cb_sync, run on the very modules being trained.

The trainer overrides TRL's hooks and hands each job to a part of its own: the rollout to `CBSyncGeneration`
(`generation`, also used by TRL's multi-turn tool loop through `_generate_single_turn`); the logprob forwards to
`logprob_forwards` (with `length_groups` and `attention_warmup`) or, in the exact mode, to `exact_mode`; the logged
logprob gap to `LogprobGap`; TRL's importance-sampling correction to `importance_sampling`; the garbage collector's
freezes, outside the steps, to `gc_points` (the training step's parts are in `training/`). Everything else is TRL's
own code; the private TRL names it relies on are listed in `trl_names`.

Several processes (accelerate, DDP): every rank keeps its own driver on its own replica and generates its own slice of
the prompts; TRL seeds each process differently, so ranks do not duplicate samples; nothing is gathered for
generation. ZeRO-3 and FSDP are refused (`checks`)."""

from __future__ import annotations

import contextlib

import torch
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context

from ...batch_invariant.trainer import default_forward
from ...config import CBConfig
from ...engine.driver import SyncCBDriver
from ..transformers import sampling_params_from_generation_config
from . import exact_mode
from .checks import check_arguments, refuse_sharded_parameters
from .generation import CBSyncGeneration
from .importance_sampling import vllm_importance_sampling
from .training.attention_warmup import AttentionWarmup
from .training.gc_points import GcPoints
from .training.length_groups import by_length, has_learned_positions, length_groups_wanted
from .training.logprob_forwards import trimmed_logps_and_entropies, warmed_logps_and_entropies
from .training.logprob_gap import LogprobGap
from .training.lora_input_casts import input_casts
from .training.training_step_compile import CompiledLayers


class CBSyncGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` with cb_sync rollouts. Sampling follows GRPOConfig (`temperature`, `top_p`, `top_k`, `min_p`,
    `repetition_penalty`, `max_completion_length`, `generation_kwargs`) as TRL reads it into the GenerationConfig of
    its transformers path, with vLLM's `presence_penalty`, `frequency_penalty` and `min_tokens` from
    `generation_kwargs` honoured as TRL's vLLM path does; an option cb_sync cannot honour (e.g. `num_beams > 1`)
    raises ValueError here. EOS is TRL's
    `eos_token_ids`. Each copy of a prompt is a request with its own seed, so a group's members differ, and their
    identical prompts share KV blocks. The driver runs a rollout in eval and inference mode and restores every
    module's training flag.

    Args:
        *args, **kwargs: GRPOTrainer's arguments. GRPOConfig's `use_vllm` and `use_transformers_continuous_batching`
            must be False; ZeRO-3, FSDP and vision-language models are refused.
        cb_config: the driver's engine settings (CBConfig()); with batch_invariant=True, the exact mode: the trainer's
            forwards of the policy run batch-invariantly too, so the generator's logprobs equal the trainer's bit for
            bit (`exact_mode`); the model may then hold no dropout. Rollouts show a progress bar only with
            progress_bar=True.
        release_after_rollout: free the KV cache after every rollout so the training step gets the memory (True),
            keep it for the next rollout (False), or free it where it is larger than
            `generation.KEPT_CACHE_MAX_BYTES` (None, the default): allocating the pools again costs a rollout time,
            which a small cache is not worth. The decode graphs outlive a release. Under DDP each rank decides on its
            own cache.
        importance_sampling_correction: apply TRL's importance-sampling correction, configured by GRPOConfig's
            `vllm_importance_sampling_*` fields, with the generator's logprobs (False: the generator runs the trained
            weights, so the ratio is 1 up to kernel numerics).
        log_logprob_diff: log the generator-vs-trainer logprob gap at every log (True; `logprob_gap`). With the
            correction on, TRL logs the gap itself.
        group_by_length: micro-batches of completions of similar lengths, and every logprob forward without the
            columns that are padding in all its rows (TRL pads a rollout's rows to its longest prompt and
            completion). The micro-batches of one rollout then make one optimizer step in another grouping of the
            same rows: this needs num_iterations=1, steps_per_generation equal to gradient_accumulation_steps, no
            term averaged per micro-batch (loss_type "bnpo", top_entropy_quantile < 1, an entropy bonus or adaptive
            entropy, an MoE aux loss), batch_invariant=False (whose forwards skip padding themselves) and a model
            without learned absolute positions (trimmed rows sit at other positions, which rotary embeddings ignore
            up to rounding). True: on, ValueError where any of these does not hold; False: TRL's micro-batches; None
            (the default): on where they all hold. Per-micro-batch metrics (entropy, clip ratios) then average over
            groups of similar lengths.
        compile_layers: run the training step's forwards and backward through each decoder layer compiled with
            `torch.compile` (False; `training_step_compile`): fewer, fused kernels, at the cost of compiles in the
            first steps; without dropout, values equal to the eager ones up to rounding. Not with
            batch_invariant=True, whose forwards run their own kernels.
        freeze_gc: keep Python's garbage collector out of the steps (False; `gc_points`): what is alive when training
            begins, after the first optimizer step and after any step a full collection ran in is collected and
            frozen there, so later collections walk only what the run made since; unfrozen when `train` returns or
            raises. Nothing is done where the collector is disabled or objects were frozen already.
    """

    def __init__(self, *args, cb_config: CBConfig | None = None, release_after_rollout: bool | None = None,
                 importance_sampling_correction: bool = False, log_logprob_diff: bool = True,
                 group_by_length: bool | None = None, compile_layers: bool = False, freeze_gc: bool = False, **kwargs):
        check_arguments(args, kwargs, cb_config, release_after_rollout, importance_sampling_correction,
                        log_logprob_diff, group_by_length, compile_layers, freeze_gc)
        super().__init__(*args, **kwargs)
        self.cb_config = cb_config if cb_config is not None else CBConfig()
        self.importance_sampling_correction = importance_sampling_correction
        self.log_logprob_diff = log_logprob_diff
        self.group_by_length = length_groups_wanted(self, group_by_length)
        self._attention_warmup = AttentionWarmup(self._tokenizer.pad_token_id, self.accelerator.autocast)
        self._compiled_layers = CompiledLayers() if compile_layers else None
        self._logprob_gap = LogprobGap(self.accelerator)
        self._rollout_logprobs = exact_mode.RolloutLogprobs()
        self._gc_points = GcPoints() if freeze_gc else None
        if self._gc_points is not None:
            self.add_callback(self._gc_points)
        refuse_sharded_parameters(self._dist.is_zero3, self._dist.is_fsdp)    # as accelerate set them up
        if getattr(self, "_is_vlm", False):
            raise ValueError("CBSyncGRPOTrainer supports text-only models; use TRL's vLLM backend for VLMs")
        if (importance_sampling_correction and self.loss_type == "vespo"
                and self.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")):
            raise ValueError("VESPO loss requires vllm_importance_sampling_mode 'token_truncate' or 'token_mask', "
                             f"got {self.vllm_importance_sampling_mode!r}")
        model = self.accelerator.unwrap_model(self.model)
        if compile_layers and not self._compiled_layers.layers(model):
            raise ValueError("compile_layers=True compiles transformers' decoder layers (GradientCheckpointingLayer), "
                             f"and {type(model).__name__} has none")
        if self.cb_config.batch_invariant:
            exact_mode.check_training(model)
        # TRL's GenerationConfig for its transformers path already merges GRPOConfig and generation_kwargs.
        params = sampling_params_from_generation_config(model, self.generation_config, logprobs=True,
                                                        vllm_options=True)[0]
        self.cb_generation = CBSyncGeneration(self.cb_config, params, release_after_rollout)

    def train(self, *args, **kwargs):
        with self._gc_points.training() if self._gc_points is not None else contextlib.nullcontext():
            return super().train(*args, **kwargs)

    @property
    def cb_driver(self) -> SyncCBDriver:
        """The persistent driver on the unwrapped model (built again only if that object changes)."""
        return self.cb_generation.driver_for(self.accelerator.unwrap_model(self.model_wrapped))

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's hook: one completion per prompt (each prompt comes repeated num_generations times). Returns
        (completion_ids, logprobs), lists aligned with prompt_ids (`CBSyncGeneration.generate`)."""
        if images is not None or has_tool_images or any(k.startswith("pixel_values") for k in multimodal_fields):
            raise NotImplementedError("CBSyncGRPOTrainer generates from text prompts only")
        model = self.accelerator.unwrap_model(self.model_wrapped)
        return self.cb_generation.generate(model, prompt_ids, self._rollout_context(model))

    @contextlib.contextmanager
    def _rollout_context(self, model):
        with profiling_context(self, "cb_sync.generate"), self._forwards(model, training=False):
            yield

    def _generate(self, prompts: list):
        try:
            generated = super()._generate(prompts)
        finally:
            self.cb_generation.after_rollout()
        if self.cb_config.batch_invariant:
            self._rollout_logprobs.keep(generated[4], generated[2])
        return generated

    def _prepare_inputs(self, generation_batch):
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self.group_by_length and self.model.training and self._buffered_inputs is not buffered:
            self._buffered_inputs = by_length(self._buffered_inputs)      # a new rollout's micro-batches
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    def training_step(self, *args, **kwargs):
        with self._forwards(self.accelerator.unwrap_model(self.model), training=True):
            return super().training_step(*args, **kwargs)

    @contextlib.contextmanager
    def _forwards(self, model, training: bool):
        """How the model's forwards run in a training step (training) or in a rollout. In the exact mode: the step's
        through the invariant path, the rollout's under the step's autocast (its logprobs must be the step's).
        Otherwise, under bf16 or fp16 mixed precision, PEFT's LoRA input casts skipped in the step, where autocast
        undoes them, and kept in the rollout (`lora_input_casts`); with compile_layers=True, the decoder layers
        compiled in the step and eager in the rollout, which runs them as the driver compiled them."""
        if self.cb_config.batch_invariant:
            with exact_mode.training_forwards(model, self.cb_config) if training else self.accelerator.autocast():
                yield
            return
        with contextlib.ExitStack() as modes:
            if self.accelerator.mixed_precision in ("bf16", "fp16"):
                modes.enter_context(input_casts(model, not training))
            if self._compiled_layers is not None:
                modes.enter_context(self._compiled_layers.switched(model, training))
            yield

    def _generate_and_score_completions(self, inputs):
        try:
            with vllm_importance_sampling(self, self.importance_sampling_correction):
                output = super()._generate_and_score_completions(inputs)
        finally:
            self._rollout_logprobs.clear()
        # old logps taken from the generator give no gap to log: they are its own numbers
        if (self._logs_gap(output) and output.get("old_per_token_logps") is not None
                and not self._rollout_logprobs.taken):
            self._logprob_gap.add(output["old_per_token_logps"], output, self._mode())
        return output

    def _compute_loss(self, model, inputs):
        # Where TRL computes no old logps (they equal the loss's own logprobs), the loss's forward gives the
        # trainer's side of the gap.
        gap_batch = inputs if self._logs_gap(inputs) and inputs.get("old_per_token_logps") is None else None
        with (vllm_importance_sampling(self, self.importance_sampling_correction),
              self._logprob_gap.from_next_forward(gap_batch, self._mode())):
            return super()._compute_loss(model, inputs)

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        out = self._logps_and_entropies(model, *args, **kwargs)
        self._logprob_gap.forward_done(out[0])
        return out

    def _logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """TRL's logprob forward as this trainer runs it. In the exact mode: the policy's through the invariant path,
        or without gradients during a rollout's scoring (TRL's old logps), the generator's own logprobs; the
        reference's through the default one, trimmed of shared padding. Otherwise trimmed by length groups or over
        whole rows."""
        unwrapped = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        exact = self.cb_config.batch_invariant
        if exact and not exact_mode.scores_reference(model, unwrapped, self.ref_model):
            if not torch.is_grad_enabled():
                old = self._rollout_logprobs.take(input_ids.size(0), logits_to_keep, input_ids.device)
                if old is not None:
                    return old, None, None
            return exact_mode.logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args,
                                                  config=self.cb_config, temperature=self.temperature,
                                                  autocast=self.accelerator.autocast,
                                                  entropy_with_grad=self._entropy_bonus_enabled, **kwargs)
        trimmed = self.group_by_length or (exact and not has_learned_positions(unwrapped))
        forward = trimmed_logps_and_entropies if trimmed else warmed_logps_and_entropies
        # the training step runs inside the exact mode's training forwards: the reference leaves them
        with default_forward(unwrapped) if exact else contextlib.nullcontext():
            return forward(super()._get_per_token_logps_and_entropies, model, input_ids, attention_mask,
                           logits_to_keep, *args, unwrapped=unwrapped, warmup=self._attention_warmup,
                           pad_token_id=self._tokenizer.pad_token_id, **kwargs)

    def _logs_gap(self, batch: dict) -> bool:
        """Whether this trainer logs the gap of a batch (with the correction on, TRL logs it)."""
        return (self.log_logprob_diff and not self.importance_sampling_correction
                and "sampling_per_token_logps" in batch)

    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log, with the logprob gap since the last log (over every rank's completion tokens)."""
        mode = self._mode()
        for key, value in self._logprob_gap.metrics(mode).items():
            self._metrics[mode][key].append(value)
        super().log(logs, start_time)
