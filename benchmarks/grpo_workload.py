"""Workload G's definition: the word-level tokenizer, the synthetic few-shot math prompts, the rewards and LoRA r32."""

from __future__ import annotations

import random
import re

REFERENCE = "trl_generate"
GEN_BATCH = 4          # completions per step: num_generations=4 x 1 prompt (per_device_train_batch_size=4)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# -- tokenizer: a word-level vocabulary covering every id of the model ------------------------------------------

SPECIALS = ["<pad>", "<eos>", "<bos>"]
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
WORDS = ["Solve", "the", "sum", ".", ",", "Think", "between", "and", "then", "answer", "Q", "A", ":", "What", "is",
         "+", "?"] + [str(d) for d in range(10)]


def make_tokenizer(vocab_size: int):
    """PreTrainedTokenizerFast over ids 0..vocab_size-1: special tokens and the prompt words first, then t<id>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = SPECIALS + TAGS + WORDS
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"t{i}": i for i in range(len(words), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # the tags stay ordinary tokens: TRL decodes completions with skip_special_tokens=True
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    assert len(tokenizer) == vocab_size
    return tokenizer


# -- data: few-shot two-digit additions, 130 prompt tokens at 6 shots -----------------------------------------------

def _digits(n: int) -> str:
    return " ".join(str(n))


def make_dataset(n: int = 64, shots: int = 6, seed: int = 0):
    """n synthetic sum prompts with `shots` worked examples each. The fingerprint is given, not hashed: hashing
    the table pickles pyarrow types, which fails with some pyarrow / Python pairs (pyarrow 26, Python 3.12)."""
    from datasets import Dataset
    from datasets.table import InMemoryTable
    rng = random.Random(seed)
    head = "Solve the sum . Think between <think> and </think> , then answer between <answer> and </answer> ."
    prompts, answers = [], []
    for _ in range(n):
        parts = [head]
        for _ in range(shots):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            parts.append(f"Q : What is {_digits(a)} + {_digits(b)} ? A : <answer> {_digits(a + b)} </answer>")
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        parts.append(f"Q : What is {_digits(a)} + {_digits(b)} ? A :")
        prompts.append(" ".join(parts))
        answers.append(_digits(a + b))
    table = InMemoryTable.from_pydict({"prompt": prompts, "answer": answers})
    return Dataset(table, fingerprint=f"cb-sync-grpo-sums-{n}-{shots}-{seed}")


# -- rewards, in the style of the reference notebook (each carries its range for the gate) ------------------------

MATCH_FORMAT = re.compile(r"</think>.*?<answer>\s*(.+?)\s*</answer>", re.DOTALL)
ANSWER = re.compile(r"<answer>\s*(.+?)\s*</answer>", re.DOTALL)


def _ranged(lo: float, hi: float):
    def mark(fn):
        fn.reward_range = (lo, hi)
        return fn
    return mark


@_ranged(0.0, 3.0)
def match_format_exactly(completions, **kwargs) -> list[float]:
    """3 when the completion closes its reasoning and gives an answer between the tags."""
    return [3.0 if MATCH_FORMAT.search(c) else 0.0 for c in completions]


@_ranged(-2.0, 2.0)
def match_format_approximately(completions, **kwargs) -> list[float]:
    """+0.5 for each of the four tags that appears exactly once, -0.5 otherwise."""
    return [sum(0.5 if c.count(tag) == 1 else -0.5 for tag in TAGS) for c in completions]


@_ranged(-1.0, 5.0)
def check_answer(completions, answer, **kwargs) -> list[float]:
    """5 for the right sum between the answer tags, -1 for a wrong one, 0 when there is none."""
    out = []
    for c, truth in zip(completions, answer):
        found = ANSWER.search(c)
        out.append(0.0 if found is None else 5.0 if found.group(1).split() == truth.split() else -1.0)
    return out


@_ranged(0.0, 1.0)
def even_token_fraction(completion_ids, **kwargs) -> list[float]:
    """The fraction of even token ids: cheap, and it varies between the samples of a group under random weights."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


REWARDS = [match_format_exactly, match_format_approximately, check_answer, even_token_fraction]
REWARD_RANGE = (sum(f.reward_range[0] for f in REWARDS), sum(f.reward_range[1] for f in REWARDS))


def lora_config():
    from peft import LoraConfig
    return LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
