"""Workloads G and G2: their shapes, the word-level tokenizer, the synthetic few-shot math prompts, the stop tokens
of G2, the rewards and LoRA r32."""

from __future__ import annotations

import dataclasses
import random
import re

REFERENCE = "trl_generate"
# --cb-group-by-length / --cb-release-cache: the trainer's group_by_length / release_after_rollout (auto: None)
AUTO_ON_OFF = {"auto": None, "on": True, "off": False}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# -- the workloads ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Workload:
    """One optimizer step = one rollout of `prompts` x `num_generations` completions (TRL's generation batch), trained
    in micro-batches of `micro_batch` (gradient_accumulation_steps = steps_per_generation = rollout / micro_batch).
    `shots`: worked examples per prompt, or a (lo, hi) range drawn per prompt. `sampling`: GRPOConfig's sampling
    fields ({}: TRL's defaults). `mean_completion`: None silences EOS; a number makes EOS live, with as many stop
    tokens as give that mean completion length under random weights (stop_token_ids)."""

    name: str
    prompts: int
    num_generations: int
    micro_batch: int
    max_completion: int
    shots: int | tuple[int, int]
    sampling: dict
    mean_completion: float | None
    cb_max_batch_tokens: int
    dataset_size: int
    steps: int
    warmup: int

    @property
    def rollout(self) -> int:
        return self.prompts * self.num_generations

    @property
    def accumulation(self) -> int:
        return self.rollout // self.micro_batch


G = Workload("G", prompts=1, num_generations=4, micro_batch=4, max_completion=512, shots=6,
             sampling=dict(temperature=0.1, top_p=0.97, min_p=0.5, top_k=5), mean_completion=None,
             cb_max_batch_tokens=512, dataset_size=64, steps=10, warmup=3)
G2 = Workload("G2", prompts=8, num_generations=8, micro_batch=16, max_completion=1024, shots=(3, 28), sampling={},
              mean_completion=400, cb_max_batch_tokens=2048, dataset_size=128, steps=10, warmup=3)
WORKLOADS = {"G": (G, dataclasses.replace(G, max_completion=8, steps=3, warmup=1)),
             "G2": (G2, dataclasses.replace(G2, prompts=2, num_generations=4, micro_batch=4, max_completion=16,
                                            mean_completion=8, steps=2, warmup=1))}
GEN_BATCH = G.rollout          # Workload G's completions per step: 1 prompt x 4 generations


def workload(name: str, tiny: bool = False) -> Workload:
    """Workload `name` ("G", "G2"): its full run, or its --tiny CPU run."""
    return WORKLOADS[name][tiny]


def stop_probability(max_len: int, mean: float) -> float:
    """The per-token stop probability p whose length law, geometric capped at max_len, has this mean:
    E[min(L, max_len)] = (1 - (1 - p)^max_len) / p (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(100):
        p = (lo + hi) / 2
        lo, hi = (p, hi) if (1 - (1 - p) ** max_len) / p > mean else (lo, p)
    return (lo + hi) / 2


def stop_token_ids(vocab_size: int, eos_token_id: int, max_len: int, mean: float) -> list[int]:
    """EOS and the top ids of the vocabulary, round(p x vocab_size) in all: with random weights their output rows are
    ordinary random rows, so at temperature 1 a token stops with probability ~ count / vocab_size = p
    (151,936 ids, 1024 tokens, mean 400: 342 stop tokens)."""
    count = round(stop_probability(max_len, mean) * vocab_size)
    return [eos_token_id] + list(range(vocab_size - count + 1, vocab_size))


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


# -- data: few-shot two-digit additions, 29 + 16..17 tokens per shot (130 at 6 shots, 77..505 at 3..28) -------

def _digits(n: int) -> str:
    return " ".join(str(n))


def make_dataset(n: int = 64, shots: int | tuple[int, int] = 6, seed: int = 0):
    """n synthetic sum prompts with `shots` worked examples each (a (lo, hi) range: a count drawn per prompt). The
    fingerprint is given, not hashed: hashing the table pickles pyarrow types, which fails with some pyarrow /
    Python pairs (pyarrow 26, Python 3.12)."""
    from datasets import Dataset
    from datasets.table import InMemoryTable
    rng = random.Random(seed)
    head = "Solve the sum . Think between <think> and </think> , then answer between <answer> and </answer> ."
    prompts, answers = [], []
    for _ in range(n):
        parts = [head]
        for _ in range(shots if isinstance(shots, int) else rng.randint(*shots)):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            parts.append(f"Q : What is {_digits(a)} + {_digits(b)} ? A : <answer> {_digits(a + b)} </answer>")
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        parts.append(f"Q : What is {_digits(a)} + {_digits(b)} ? A :")
        prompts.append(" ".join(parts))
        answers.append(_digits(a + b))
    table = InMemoryTable.from_pydict({"prompt": prompts, "answer": answers})
    return Dataset(table, fingerprint=f"cb-sync-grpo-sums-{n}-{_tag(shots)}-{seed}")


def _tag(shots: int | tuple[int, int]) -> str:
    return str(shots) if isinstance(shots, int) else f"{shots[0]}to{shots[1]}"


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
