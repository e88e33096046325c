"""TRL integration: `CBSyncGRPOTrainer`, a `trl.GRPOTrainer` whose rollouts come from cb_sync, run on the very
modules being trained.

    trainer.py                CBSyncGRPOTrainer: TRL's hooks, each handing its job to a part below
    generation.py             CBSyncGeneration: the driver's life cycle, the rollout, the release policy
    importance_sampling.py    TRL's importance-sampling correction, switched on for cb_sync's logprobs
    exact_mode.py             CBConfig(batch_invariant=True) on the trainer's side
    checks.py                 what the trainer refuses before TRL builds anything
    trl_names.py              TRL's private names the trainer uses, and which of them the installed TRL lacks
    training/                 the training step's speed-ups and metrics:
      logprob_forwards.py       TRL's logprob forward as the trainer runs it (whole rows, or trimmed by length groups)
      length_groups.py          micro-batches by length, forwards without shared padding, their widths
      attention_warmup.py       cuDNN attention's kernel builds, done before a forward's first use
      lora_input_casts.py       PEFT's LoRA input casts skipped where autocast undoes them
      training_step_compile.py  the decoder layers compiled for the training step
      gc_points.py              the garbage collector's freezes, outside the steps
      logprob_gap.py            the generator-vs-trainer logprob gap it logs
"""

from .trainer import CBSyncGRPOTrainer

__all__ = ["CBSyncGRPOTrainer"]
