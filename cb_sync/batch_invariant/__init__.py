"""The exact mode, `CBConfig(batch_invariant=True)`, all of it: a row's result depends on that row alone.

`ops`: linear layers, norms and last-dimension reductions in fixed row blocks (`invariant_ops`); `row_mean`: the
CUDA mean of one program per row; `fused_kernels` + `fused_forwards`: RMS norms, rotary embeddings and SiLU x up as
one row-invariant launch each, swapped into the forwards of the model families they serve; `attention` +
`attention_kernel`: row-invariant paged attention; `training_attention`, `packing`, `logprobs` and `trainer`: the
trainer's forward that computes the generator's numbers bit for bit; `lora`: the LoRA kernel with gradients in the
generator's fixed tiling."""

from .ops import ROWS, check_model, invariant_ops, suspended

__all__ = ["ROWS", "check_model", "invariant_ops", "suspended"]
