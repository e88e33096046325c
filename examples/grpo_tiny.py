"""GRPO with cb_sync rollouts, end to end, on a tiny random Qwen3 and a word-level tokenizer built offline.

    python examples/grpo_tiny.py [--output-dir grpo_tiny] [--steps 2]

Runs on the CPU in seconds and downloads nothing. For a real run, load the model and tokenizer with
`from_pretrained` and keep the rest: the trainer's rollouts come from the very modules it trains (here a LoRA
adapter), and a KV cache over 1 GiB is given back before each training step (`release_after_rollout`).
"""

from __future__ import annotations

import argparse

import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config
from trl import GRPOConfig

from cb_sync import CBConfig
from cb_sync.cli import positive_int
from cb_sync.integrations.trl import CBSyncGRPOTrainer

VOCAB = 64


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Words w2..w63 plus <pad> and <eos>, one id each."""
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         eos_token_id=1, pad_token_id=0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def make_dataset(n: int = 16) -> Dataset:
    gen = torch.Generator().manual_seed(0)
    prompts = [" ".join(f"w{t}" for t in torch.randint(2, VOCAB, (6,), generator=gen).tolist()) for _ in range(n)]
    return Dataset.from_dict({"prompt": prompts})


def even_ids(completion_ids, **kwargs) -> list[float]:
    """Reward: the fraction of even token ids in each completion."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def train(output_dir: str = "grpo_tiny", steps: int = 2) -> CBSyncGRPOTrainer:
    """`steps` GRPO steps on a LoRA adapter of the tiny model; returns the trainer."""
    model, tokenizer, dataset = make_model(), make_tokenizer(), make_dataset()
    on_gpu = torch.cuda.is_available()
    args = GRPOConfig(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                      bf16=on_gpu, use_cpu=not on_gpu)       # GRPOConfig defaults to bf16, which needs a GPU
    trainer = CBSyncGRPOTrainer(model=model, reward_funcs=even_ids, args=args, train_dataset=dataset,
                                processing_class=tokenizer,  # without it TRL looks for a tokenizer on the Hub
                                peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
                                cb_config=CBConfig(compile=on_gpu))  # compiling pays off on a GPU only
    trainer.train()
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="grpo_tiny", help="the Trainer's output_dir (grpo_tiny)")
    parser.add_argument("--steps", type=positive_int, default=2, help="training steps (2)")
    cli = parser.parse_args()
    train(cli.output_dir, cli.steps)
