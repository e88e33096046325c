"""Unsloth's own GRPO path on Workload G, in a process of its own: benchmarks.grpo_peers starts it with Unsloth's
target directory (unsloth, unsloth_zoo, trl 1.15, datasets < 5) first on the Python path. Unsloth is imported before
transformers, peft and TRL (it patches them on import), then benchmarks.grpo runs the `unsloth` backend, whose
trainer `unsloth_trainer` builds:
    python -m benchmarks.grpo_unsloth --backends unsloth --row-file FILE [benchmarks.grpo's arguments]

The model is the benchmark's saved copy, loaded by FastLanguageModel.from_pretrained in bf16 (load_in_4bit=False,
fast_inference=False: rollouts through Unsloth's HF-generate path, not vLLM); LoRA r32 on the same 7 projections
through FastLanguageModel.get_peft_model with Unsloth's gradient checkpointing; Unsloth's patched GRPOTrainer with
the benchmark's GRPOConfig, rewards, data and tokenizer (fix_tokenizer=False keeps the offline tokenizer as is).
"""

try:
    import unsloth  # noqa: F401  (first: it patches transformers, peft and trl on import)
    IMPORT_ERROR = None
except Exception as error:             # the backend's row then carries the error
    IMPORT_ERROR = error

import torch  # noqa: E402


def unsloth_trainer(args, config, model: str, reward_funcs, train_dataset, processing_class, callbacks, peft_config):
    """Unsloth's GRPOTrainer on the model saved at `model` (a directory), LoRA as peft_config describes it."""
    if IMPORT_ERROR is not None:
        raise RuntimeError(f"unsloth could not be imported: {IMPORT_ERROR!r}")
    from trl import GRPOTrainer
    from unsloth import FastLanguageModel
    prompts = processing_class(list(train_dataset["prompt"]), add_special_tokens=False)["input_ids"]
    prompt_len = max(len(ids) for ids in prompts)
    fast, _ = FastLanguageModel.from_pretrained(
        model_name=model, max_seq_length=prompt_len + args.max_completion, dtype=torch.bfloat16, load_in_4bit=False,
        fast_inference=False, max_lora_rank=peft_config.r, fix_tokenizer=False)
    fast = FastLanguageModel.get_peft_model(
        fast, r=peft_config.r, lora_alpha=peft_config.lora_alpha, lora_dropout=peft_config.lora_dropout,
        target_modules=sorted(peft_config.target_modules), bias="none", use_gradient_checkpointing="unsloth",
        random_state=args.seed)
    return GRPOTrainer(model=fast, args=config, reward_funcs=reward_funcs, train_dataset=train_dataset,
                       processing_class=processing_class, callbacks=callbacks)


def main(argv=None):
    import sys
    sys.modules.setdefault("benchmarks.grpo_unsloth", sys.modules[__name__])   # run as a script: one instance
    from benchmarks import grpo
    return grpo.main(argv)


if __name__ == "__main__":
    main()
