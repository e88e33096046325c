"""TRL integration: CBSyncGRPOTrainer, a `trl.GRPOTrainer` whose rollouts come from cb_sync.

Rollouts come from the very modules being trained: one persistent `SyncCBDriver` runs on
`accelerator.unwrap_model(model)` (a PeftModel under `peft_config=` or when one is passed). The trainer overrides
`_generate_single_turn` (also used by TRL's multi-turn tool loop); everything else is TRL's own code.

Sampling follows GRPOConfig (`temperature`, `top_p`, `top_k`, `min_p`, `max_completion_length`, `generation_kwargs`) as
read from the GenerationConfig TRL builds for its transformers path; options cb_sync cannot honour (e.g.
`repetition_penalty != 1`) raise ValueError at construction. EOS is TRL's `eos_token_ids`. TRL hands over each prompt
repeated `num_generations` times; each copy is a request with its own fresh seed, so a group's members differ, and their
identical prompts share KV blocks. The driver runs the rollout in eval + inference mode and restores every module's
training flag; a KV cache larger than `KEPT_CACHE_MAX_BYTES` is released after each rollout (`release_after_rollout`;
the captured decode graphs are kept and replayed over the next rollout's cache wherever it lands, see
`SyncCBDriver.release`).

Before the first logprob forward of each variety (with or without gradients, with or without padding), the trainer
runs the model on short rows of that variety at two lengths (`attention_warmup`): cuDNN attention builds kernels at
run time for each kind of sequence length, and the first forward of a new kind would otherwise cost a step ~2 s
mid-run. A forward with gradients and padding whose width is 64 past a multiple of 128 is left-padded to the next
multiple: there cuDNN attention's backward gave NaN gradients (seen on torch 2.11, avoided on every version;
`length_groups.FAULTY_WIDTH`). Under bf16 or fp16 mixed precision the training step's forwards skip PEFT's cast of
LoRA inputs to the fp32 adapter dtype, which autocast undoes (`lora_input_casts`: the same bits, fewer copies);
rollouts keep it. `compile_layers=True` runs
the training step's forwards and backward through each decoder layer compiled (`compiled_layers`); rollouts run
them as the driver compiled them.

The generator's per-token logprobs (of the sampled token under log_softmax(logits / temperature), what the trainer
recomputes) reach TRL as `sampling_per_token_logps`. Each log logs `sampling/sampling_logp_difference/{mean,p95,max}`
of |generator - trainer| and `sampling/ratio_outside_0.9_1.1`, the share of tokens whose ratio
p_trainer / p_generator lies outside [0.9, 1.1], over the completion tokens since the last log: against TRL's old logps
where it computes them, else against the logprobs of the loss's own forward (the same weights: no extra forward);
`log_logprob_diff=False` skips it. `importance_sampling_correction=True` runs TRL's importance-sampling correction on
these logprobs (configured by GRPOConfig's `vllm_importance_sampling_*` fields), which TRL gates on `use_vllm`: the
flags are set for the duration of `_generate_and_score_completions` and `_compute_loss` only (no vLLM object is made or
reached, and the weight-sync counter is kept current).

With `cb_config=CBConfig(batch_invariant=True)` the rollouts and the trainer's own forwards of the policy (loss and old
logps; also a forward recomputed by gradient checkpointing) run batch-invariantly (`invariant_forward`): the
generator's logprobs equal the trainer's bit for bit, so the gap is exactly 0 and every importance ratio exactly 1.
The reference policy's forward (KL only) takes the default path.
The rollout then runs under the trainer's autocast state, and the trained model may hold no dropout (ValueError).

Several processes (accelerate, DDP): every rank keeps its own driver on its own replica and generates its own slice of
the prompts; TRL seeds each process differently, so ranks do not duplicate samples; nothing is gathered for generation.
ZeRO-3 and FSDP shard parameters, so a rank does not hold the weights the driver (and its graphs) would run on: the
trainer refuses them with a ValueError. Use DDP or ZeRO-1/2, or TRL's vLLM backend."""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from contextlib import contextmanager

import torch
from transformers.integrations import is_deepspeed_zero3_enabled
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context

from ...batch_invariant.ops import check_model
from ...batch_invariant.trainer import (
    default_forward,
    invariant_logits,
    invariant_logprobs,
    invariant_training,
)
from ...config import CBConfig
from ...engine.driver import SyncCBDriver
from ...engine.validation import learned_position_limit
from ...model_patching.swaps import base_model, module_list
from .attention_warmup import AttentionWarmup, prefers_cudnn_attention
from .training_step_compile import CompiledLayers
from .length_groups import (
    by_length,
    clear_of_faulty_width,
    left_padded,
    padding_columns,
    right_extended,
)
from .lora_input_casts import input_casts
from ..transformers import sampling_params_from_generation_config

__all__ = ["CBSyncGRPOTrainer"]

KEPT_CACHE_MAX_BYTES = 1 << 30      # release_after_rollout=None keeps KV caches up to this size through training


class CBSyncGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` with cb_sync rollouts. Takes GRPOTrainer's arguments, plus (keyword-only):

    cb_config: engine settings of the driver (CBConfig()); with batch_invariant=True the trainer's forwards too.
        Rollouts show a progress bar only with progress_bar=True (TRL's own bar is on the terminal).
    release_after_rollout: free the KV cache after every rollout so the training step gets the memory (True), keep it
        for the next rollout (False), or free it where it is larger than KEPT_CACHE_MAX_BYTES (None, the default).
        The Triton backend's decode graphs outlive a release, but allocating the pools again costs a rollout time:
        ~0.3 s of a 2.2 s rollout for a small cache (4 completions of 642 tokens at 4B: 0.4 GiB, kept), 1.035x the
        driver alone for a large one (64 of ~1.3k tokens at 4B: ~12 GiB, freed). Under DDP each rank decides on its
        own cache.
    importance_sampling_correction: apply TRL's importance-sampling correction with the generator's logprobs (False;
        the generator runs the trained weights, so the ratio is close to 1 up to kernel numerics).
    log_logprob_diff: log the generator-vs-trainer logprob gap at every log (True; see the module's docstring).
    group_by_length: micro-batches of completions of similar lengths, and every logprob forward without the columns
        that are padding in all its rows. TRL pads a rollout's rows to its longest prompt and completion, so with
        varied lengths most of a forward is padding. The micro-batches of one rollout then make one optimizer step in
        another grouping of the same rows: needs num_iterations=1, steps_per_generation equal to
        gradient_accumulation_steps, and no term averaged per micro-batch (loss_type "bnpo", top_entropy_quantile < 1,
        an entropy bonus or adaptive entropy, an MoE aux loss), outside batch-invariant mode (whose forwards skip
        padding themselves) and a model without learned absolute positions (trimmed rows sit at other positions,
        which rotary embeddings ignore up to rounding). True: on, ValueError where any of these does not hold;
        False: TRL's micro-batches; None (the default): on where they all hold. Per-micro-batch metrics (entropy,
        clip ratios) then average over groups of similar lengths.
    compile_layers: run the training step's forwards and backward through each decoder layer compiled with
        `torch.compile` (False): fewer, fused kernels, at the cost of compiles in the first steps (one per variety of
        forward, shared by all layers); without dropout, values equal to the eager ones up to rounding. Not with
        batch_invariant=True, whose forwards run their own kernels."""

    def __init__(self, *args, cb_config: CBConfig | None = None, release_after_rollout: bool | None = None,
                 importance_sampling_correction: bool = False, log_logprob_diff: bool = True,
                 group_by_length: bool | None = None, compile_layers: bool = False, **kwargs):
        if cb_config is not None and not isinstance(cb_config, CBConfig):
            raise ValueError(f"cb_config must be a CBConfig, got {type(cb_config).__name__}")
        for name, value in (("release_after_rollout", release_after_rollout), ("group_by_length", group_by_length)):
            if not (value is None or isinstance(value, bool)):
                raise ValueError(f"{name} must be True, False or None, got {value!r}")
        for name, value in (("importance_sampling_correction", importance_sampling_correction),
                            ("log_logprob_diff", log_logprob_diff), ("compile_layers", compile_layers)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        if compile_layers and cb_config is not None and cb_config.batch_invariant:
            raise ValueError("compile_layers=True cannot run with CBConfig(batch_invariant=True): its forwards run "
                             "their own kernels, which compiling would change")
        grpo_args = inspect.signature(GRPOTrainer.__init__).bind(None, *args, **kwargs).arguments.get("args")
        if grpo_args is not None and (grpo_args.use_vllm or grpo_args.use_transformers_continuous_batching):
            raise ValueError("CBSyncGRPOTrainer generates with cb_sync: set use_vllm=False and "
                             "use_transformers_continuous_batching=False in GRPOConfig")
        _refuse_sharded_parameters(is_deepspeed_zero3_enabled(), _fsdp_asked(grpo_args))
        super().__init__(*args, **kwargs)
        self.cb_config = cb_config if cb_config is not None else CBConfig()
        self.release_after_rollout = release_after_rollout
        self.importance_sampling_correction = importance_sampling_correction
        self.log_logprob_diff = log_logprob_diff
        self.group_by_length = _length_groups_wanted(self, group_by_length)
        self._attention_warmup = AttentionWarmup(self._tokenizer.pad_token_id)
        self._compiled_layers = CompiledLayers() if compile_layers else None
        self._logprob_gaps = {}         # mode -> trainer - generator logprobs since the last log (every rank's)
        self._gap_batch = None          # the loss's batch, until its first logprobs are compared
        self._cb_driver: SyncCBDriver | None = None
        self._cb_driver_key = None
        _refuse_sharded_parameters(self._dist.is_zero3, self._dist.is_fsdp)    # as accelerate set them up
        if getattr(self, "_is_vlm", False):
            raise ValueError("CBSyncGRPOTrainer supports text-only models; use TRL's vLLM backend for VLMs")
        if (importance_sampling_correction and self.loss_type == "vespo"
                and self.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")):
            raise ValueError("VESPO loss requires vllm_importance_sampling_mode 'token_truncate' or 'token_mask', "
                             f"got {self.vllm_importance_sampling_mode!r}")
        # TRL's GenerationConfig for its transformers path already merges GRPOConfig and generation_kwargs.
        model = self.accelerator.unwrap_model(self.model)
        if compile_layers and not self._compiled_layers.layers(model):
            raise ValueError("compile_layers=True compiles transformers' decoder layers (GradientCheckpointingLayer), "
                             f"and {type(model).__name__} has none")
        if self.cb_config.batch_invariant:
            _check_invariant_training(model)
        self._cb_params = sampling_params_from_generation_config(model, self.generation_config, logprobs=True)[0]

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
        if driver.cache.num_blocks == 0:
            return_allocator_cache(driver.device)
        # batch-invariant: the rollout runs under the autocast state of the trainer's forward, as its logprobs must
        autocast = self.accelerator.autocast() if self.cb_config.batch_invariant else contextlib.nullcontext()
        with (profiling_context(self, "cb_sync.generate"), autocast, self._lora_input_casts(driver.model, True),
              self._layers_compiled(driver.model, False)):
            results = driver.generate(prompt_ids, self._cb_params, progress_bar=bool(self.cb_config.progress_bar))
        return [r.token_ids for r in results], [r.logprobs for r in results]

    def _generate(self, prompts: list):
        try:
            return super()._generate(prompts)
        finally:
            driver = self._cb_driver
            if driver is not None and releases_cache(self.release_after_rollout, driver.cache.nbytes):
                driver.release(keep_graphs=True)

    def _prepare_inputs(self, generation_batch):
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self.group_by_length and self.model.training and self._buffered_inputs is not buffered:
            self._buffered_inputs = by_length(self._buffered_inputs)      # a new rollout's micro-batches
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    def training_step(self, *args, **kwargs):
        if not self.cb_config.batch_invariant:
            model = self.accelerator.unwrap_model(self.model)
            with self._lora_input_casts(model, False), self._layers_compiled(model, True):
                return super().training_step(*args, **kwargs)
        # gradient checkpointing recomputes the forward during backward: there too through the invariant path
        cfg = self.cb_config
        with invariant_training(self.accelerator.unwrap_model(self.model), cfg.lora_kernels, cfg.tuning.lora):
            return super().training_step(*args, **kwargs)

    def _lora_input_casts(self, model, enabled: bool):
        """`lora_input_casts.input_casts(model, enabled)` under bf16 or fp16 mixed precision, where TRL runs every
        forward of a training step under the accelerator's autocast and PEFT's cast of LoRA inputs to fp32 is a round
        trip (off for the step, on again for its rollout); elsewhere PEFT's settings are left alone."""
        if self.cb_config.batch_invariant or self.accelerator.mixed_precision not in ("bf16", "fp16"):
            return contextlib.nullcontext()
        return input_casts(model, enabled)

    def _layers_compiled(self, model, on: bool):
        """With compile_layers=True, the model's decoder layers compiled (a training step) or eager (its rollout)."""
        if self._compiled_layers is None:
            return contextlib.nullcontext()
        return self._compiled_layers.switched(model, on)

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
        # With the correction on, TRL logs the gap itself (its mean and max, and the importance ratios).
        if (self.log_logprob_diff and not self.importance_sampling_correction and "sampling_per_token_logps" in output
                and output.get("old_per_token_logps") is not None):
            self._add_logprob_gap(output["old_per_token_logps"], output)
        return output

    def _compute_loss(self, model, inputs):
        # Where TRL computes no old logps (they equal the loss's own logprobs, as TRL says), the loss's forward, its
        # first `_get_per_token_logps_and_entropies`, gives the trainer's side of the gap.
        if (self.log_logprob_diff and not self.importance_sampling_correction and "sampling_per_token_logps" in inputs
                and inputs.get("old_per_token_logps") is None):
            self._gap_batch = inputs
        try:
            with self._importance_sampling_flags():
                return super()._compute_loss(model, inputs)
        finally:
            self._gap_batch = None

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        mode = contextlib.nullcontext()
        if self.cb_config.batch_invariant and not self._scores_reference(model):
            compute = self._invariant_logps_and_entropies
        else:
            compute = self._trimmed_logps_and_entropies if self.group_by_length else self._warmed_logps_and_entropies
            if self.cb_config.batch_invariant:      # the training step runs inside invariant_training
                mode = default_forward(self.accelerator.unwrap_model(model, keep_torch_compile=False))
        with mode:
            out = compute(model, *args, **kwargs)
        batch, self._gap_batch = self._gap_batch, None
        if batch is not None:
            self._add_logprob_gap(out[0].detach(), batch)
        return out

    def _scores_reference(self, model) -> bool:
        """Whether a logprob forward scores TRL's reference policy: without gradients (as TRL always scores it), its
        ref_model, or the PEFT model with its adapters disabled or its "ref" adapter active. Those logprobs enter the
        KL term only, never the generator-vs-trainer comparison, so batch-invariant mode leaves them to the default
        path. A forward with gradients is the policy's, whatever the adapters' state."""
        if torch.is_grad_enabled():
            return False
        if self.ref_model is not None and model is self.ref_model:
            return True
        unwrapped = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        active = getattr(unwrapped, "active_adapter", None)
        if active == "ref" or (isinstance(active, (list, tuple)) and "ref" in active):
            return True
        return any(getattr(module, "disable_adapters", False) for module in _adapter_layers(unwrapped))

    def _warmed_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, *args,
                                    **kwargs):
        """TRL's `_get_per_token_logps_and_entropies`, after cuDNN attention's builds for the varieties of forward its
        chunks of rows will be (`attention_warmup`), at a width clear of cuDNN attention's fault (`_clear_of_fault`)."""
        unwrapped = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        input_ids, attention_mask = self._clear_of_fault(unwrapped, input_ids, attention_mask)
        if self._attention_warmup.pending(unwrapped):
            chunks = attention_mask.split(batch_size or attention_mask.size(0))
            for masked in set(torch.stack([~chunk.bool().all() for chunk in chunks]).tolist()):
                self._warm_attention(unwrapped, masked)
        return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size,
                                                          *args, **kwargs)

    def _warm_attention(self, model, masked: bool) -> None:
        """cuDNN attention's builds for a forward with or without padding (`attention_warmup`), under the autocast
        state of the forward it warms."""
        with self.accelerator.autocast():
            self._attention_warmup.before_forward(model, masked)

    def _clear_of_fault(self, model, input_ids, attention_mask):
        """A forward with gradients through cuDNN attention, widened where its width would give NaN gradients
        (`length_groups.clear_of_faulty_width`); models with learned absolute positions keep theirs (their logprobs
        would change)."""
        if not torch.is_grad_enabled() or not prefers_cudnn_attention(model):
            return input_ids, attention_mask
        if _has_learned_positions(model):
            return input_ids, attention_mask
        return clear_of_faulty_width(input_ids, attention_mask, self._tokenizer.pad_token_id)

    def _trimmed_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                     compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's `_get_per_token_logps_and_entropies`, each chunk of rows without the columns that are padding in all of
        them (the outputs zero there) and widened to a width that repeats across steps: on the left where padding is
        left (`left_padded`), else, where SDPA takes cuDNN attention and positions are rotary, on the right with
        columns no real one attends to (`right_extended`); without gradients the chunks take the rows in order of
        length."""
        if compute_aux_loss or any(value is not None for value in multimodal.values()):
            raise NotImplementedError("group_by_length scores text-only models without an MoE aux loss")
        trl_forward = super()._get_per_token_logps_and_entropies
        rows, pad_token_id = input_ids.size(0), self._tokenizer.pad_token_id
        batch_size = batch_size or rows
        sort_rows = batch_size < rows and not torch.is_grad_enabled()
        order = (torch.argsort(attention_mask[:, -logits_to_keep:].sum(1), stable=True) if sort_rows
                 else torch.arange(rows, device=input_ids.device))
        unwrapped = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        widen_unmasked = prefers_cudnn_attention(unwrapped)     # where cuDNN attention builds a plan per width
        logps, entropies = [], []
        for start in range(0, rows, batch_size):
            chunk = order[start:start + batch_size]
            mask = attention_mask[chunk]
            leading, trailing = padding_columns(mask, logits_to_keep)
            columns = slice(leading, input_ids.size(1) - trailing)
            ids, mask = input_ids[chunk, columns], mask[:, columns]
            masked, extra = not bool(mask.all()), 0
            if masked:                      # a forward without padding keeps SDPA's unmasked causal path
                ids, mask = self._clear_of_fault(unwrapped, *left_padded(ids, mask, pad_token_id))
            elif widen_unmasked:
                ids, mask, extra = right_extended(ids, mask, pad_token_id)
            self._warm_attention(unwrapped, masked)
            kept = logits_to_keep - trailing
            chunk_logps, chunk_entropies, _ = trl_forward(model, ids, mask, kept + extra,
                                                          compute_entropy=compute_entropy)
            logps.append(torch.nn.functional.pad(chunk_logps[:, :kept], (0, trailing)))
            if compute_entropy:
                entropies.append(torch.nn.functional.pad(chunk_entropies[:, :kept], (0, trailing)))
        logps, entropies = torch.cat(logps), torch.cat(entropies) if compute_entropy else None
        if sort_rows:
            unsorted = torch.argsort(order)
            logps, entropies = logps[unsorted], entropies[unsorted] if compute_entropy else None
        return logps, entropies, None

    def _invariant_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                       compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's `_get_per_token_logps_and_entropies` in batch-invariant mode: the logprobs of the generator's kernels
        and op (`invariant_forward`), equal to the rollout's bit for bit; entropies from the same logits."""
        if compute_aux_loss or any(value is not None for value in multimodal.values()):
            raise NotImplementedError("batch-invariant mode scores text-only models without an MoE aux loss")
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
            with self.accelerator.autocast():
                cfg = self.cb_config
                logits = invariant_logits(model, ids, mask, logits_to_keep, cfg.block_size, cfg.lora_kernels,
                                          cfg.tuning.lora)
            logps.append(invariant_logprobs(logits, ids[:, -logits_to_keep:], self.temperature))
            if compute_entropy:     # with gradients only for TRL's entropy bonus
                bonus = self._entropy_bonus_enabled
                with torch.set_grad_enabled(torch.is_grad_enabled() and bonus):
                    log_probs = torch.log_softmax(logits.float() / self.temperature, dim=-1)
                    entropies.append(-(log_probs.exp() * log_probs).sum(-1))
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    def _add_logprob_gap(self, trainer_logps: torch.Tensor, batch: dict) -> None:
        """Keep trainer - generator logprob over this batch's completion tokens, gathered over ranks, until `log`."""
        mask = batch["completion_mask"] if "tool_mask" not in batch else batch["completion_mask"] * batch["tool_mask"]
        delta = trainer_logps.float() - batch["sampling_per_token_logps"].float()
        delta = delta[mask.bool() & ~torch.isnan(delta)].to(self.accelerator.device)
        # ranks hold different token counts: pad with NaN to the longest, gather, drop the padding
        delta = self.accelerator.gather(self.accelerator.pad_across_processes(delta, pad_index=math.nan))
        mode = "train" if self.model.training else "eval"
        self._logprob_gaps.setdefault(mode, []).append(delta[~torch.isnan(delta)])

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log, with the logprob gap since the last log (over every rank's completion tokens)."""
        mode = "train" if self.model.training else "eval"
        deltas = self._logprob_gaps.pop(mode, [])
        delta = torch.cat(deltas) if deltas else torch.empty(0)
        if delta.numel():
            gap = delta.abs()
            outside = (delta > math.log(1.1)) | (delta < math.log(0.9))
            metrics = self._metrics[mode]
            metrics["sampling/sampling_logp_difference/mean"].append(gap.mean().item())
            metrics["sampling/sampling_logp_difference/p95"].append(quantile(gap, 0.95))
            metrics["sampling/sampling_logp_difference/max"].append(gap.max().item())
            metrics["sampling/ratio_outside_0.9_1.1"].append(outside.float().mean().item())
        super().log(logs, start_time)


def quantile(values: torch.Tensor, q: float) -> float:
    """torch.quantile's (linear interpolation) of a 1-D tensor of any size: torch.quantile refuses over 2**24 values,
    which a run's gathered completion tokens reach."""
    ordered = values.sort().values
    position = q * (ordered.numel() - 1)
    below = int(position)
    above = min(below + 1, ordered.numel() - 1)
    return torch.lerp(ordered[below], ordered[above], position - below).item()


def _has_learned_positions(model) -> bool:
    """A table of absolute positions (GPT-2, OPT, ...): moving a row's tokens to other columns changes its logits."""
    return learned_position_limit(model.config.get_text_config()) is not None


def _fsdp_asked(args) -> bool:
    """FSDP asked for in the arguments or by `accelerate launch` (which says so in the environment)."""
    from_launch = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true", "yes")
    return bool(getattr(args, "fsdp", None)) or from_launch


def _refuse_sharded_parameters(zero3: bool, fsdp: bool) -> None:
    if zero3 or fsdp:
        raise ValueError("CBSyncGRPOTrainer does not support ZeRO-3 or FSDP: parameters are sharded, so a rank "
                         "cannot generate from the modules it trains. Use DDP or ZeRO stage 1/2.")


def return_allocator_cache(device: torch.device) -> None:
    """Before a rollout allocates its KV pools again: the training step's cached blocks go back to the device (they
    are split into sizes the pools cannot use), so the card holds the larger of rollout and training, not both."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def releases_cache(asked: bool | None, cache_bytes: int) -> bool:
    """Whether the trainer frees a rollout's KV cache of cache_bytes (asked: release_after_rollout)."""
    return cache_bytes > KEPT_CACHE_MAX_BYTES if asked is None else asked


def _length_groups_wanted(trainer: CBSyncGRPOTrainer, asked: bool | None) -> bool:
    """group_by_length regroups one rollout's rows among the micro-batches of one optimizer step and moves trimmed
    rows to other positions: whether it runs (asked None: where the settings and the model allow it; True:
    ValueError where they do not)."""
    args = trainer.args
    learned_positions = _has_learned_positions(trainer.accelerator.unwrap_model(trainer.model))
    wrong = [f"{name}={value!r}" for name, value, ok in (
        ("num_iterations", trainer.num_iterations, trainer.num_iterations == 1),
        ("steps_per_generation", args.steps_per_generation,
         args.steps_per_generation == args.gradient_accumulation_steps),
        ("loss_type", trainer.loss_type, trainer.loss_type != "bnpo"),
        ("top_entropy_quantile", trainer.top_entropy_quantile, trainer.top_entropy_quantile == 1.0),
        ("entropy_coef", trainer.entropy_coef, not trainer._entropy_bonus_enabled),
        ("use_adaptive_entropy", trainer.use_adaptive_entropy, not trainer.use_adaptive_entropy),
        ("router_aux_loss_coef", trainer.router_aux_loss_coef, not trainer.aux_loss_enabled),
        ("CBConfig.batch_invariant", trainer.cb_config.batch_invariant, not trainer.cb_config.batch_invariant),
        ("learned absolute positions", learned_positions, not learned_positions)) if not ok]
    if asked is None:
        return not wrong
    if asked and wrong:
        raise ValueError("group_by_length=True needs num_iterations=1, steps_per_generation equal to "
                         f"gradient_accumulation_steps ({args.gradient_accumulation_steps}), a loss_type other than "
                         "'bnpo', top_entropy_quantile=1.0, no entropy bonus and no MoE aux loss (each averaged per "
                         "micro-batch), batch_invariant=False (its forwards skip padding themselves) and a model "
                         "without learned absolute positions (trimmed rows move to other positions), got "
                         f"{', '.join(wrong)}")
    return asked


def _check_invariant_training(model: torch.nn.Module) -> None:
    """Batch-invariant mode matches the training forward to the rollout's: layers it covers (`check_model`), and no
    dropout that would differ between them."""
    check_model(model)
    dropouts = sorted({f"{type(m).__name__}(p={m.p})" for m in model.modules()
                       if isinstance(m, torch.nn.Dropout) and m.p > 0})
    config = base_model(model).config.get_text_config()   # models that call F.dropout with their config's rates
    dropouts += sorted(f"{key}={value}" for key, value in config.to_dict().items()
                       if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0)
    if dropouts:
        raise ValueError("CBConfig(batch_invariant=True) needs a training forward without dropout (the rollout runs "
                         f"none), got {', '.join(dropouts)}: set lora_dropout=0 (and the model's dropout to 0)")


def _adapter_layers(model: torch.nn.Module):
    """PEFT's tuner layers of `model` (LoRA's and other adapters'; none where PEFT is not installed)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return
    yield from (module for module in module_list(model) if isinstance(module, BaseTunerLayer))
