"""CBSyncGRPOTrainer under data parallelism, on the CPU: two processes started by `accelerate launch` (gloo, DDP)
train a tiny random Qwen3 (fp32) for two GRPO steps. Run as a script, this file is the per-rank worker: it records
what each rank's driver was given and returned, and writes it to <out>/rank<r>.json (weights to rank<r>.pt).

`accelerate launch --cpu --num_processes 2` starts a single process unless MPI is set up; `--multi_gpu` with the
trainer's `use_cpu=True` starts two processes that join a gloo group (accelerate's MULTI_CPU), the same launcher
that runs on GPUs. ZeRO-3 and FSDP cannot be set up on a CPU (no deepspeed; accelerate's FSDP needs devices), so the
refusal is checked in one process with TRL's DistributedBackend reporting them.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 128
WORLD = 2
PER_DEVICE = 6          # completions per rank per step: with 4 generations, one group spans both ranks
NUM_GENERATIONS = 4
STEPS = 2
NEW_TOKENS = 4


# -- the worker (one per rank) ------------------------------------------------------------------------------------

def build_parts():
    """Tokenizer, model (same seed on every rank), prompts and reward."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Qwen3Config

    from benchmarks.harness import make_tokenizer
    tokenizer = make_tokenizer(VOCAB)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         initializer_range=0.02,  # flat logits: samples of a group differ
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    prompts = [" ".join(f"t{t}" for t in torch.randint(40, VOCAB, (int(n),), generator=gen).tolist())
               for n in torch.randint(3, 9, (32,), generator=gen)]
    return tokenizer, model, Dataset.from_dict({"prompt": prompts})


def even_fraction(completion_ids, **kwargs) -> list[float]:
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def worker(out: Path) -> None:
    """One rank: two GRPO steps, recording every driver call, request seed and rollout, TRL's gathered log of the
    step and the rank's own logprob-gap values before they are gathered."""
    from trl import GRPOConfig

    from cb_sync import CBConfig, SyncCBDriver
    from cb_sync.integrations.trl import CBSyncGRPOTrainer

    tokenizer, model, dataset = build_parts()
    args = GRPOConfig(output_dir=str(out / "trainer"), per_device_train_batch_size=PER_DEVICE,
                      num_generations=NUM_GENERATIONS, max_completion_length=NEW_TOKENS, max_steps=STEPS,
                      learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                      seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = CBSyncGRPOTrainer(model=model, reward_funcs=even_fraction, args=args, train_dataset=dataset,
                                processing_class=tokenizer, cb_config=CBConfig(block_size=4, max_batch_tokens=64),
                                release_after_rollout=True)   # the default keeps caches this small
    rank = trainer.accelerator.process_index
    record = {"rank": rank, "world": trainer.accelerator.num_processes, "rollouts": [], "driver_calls": [],
              "seeds": [], "gathered": [], "local_logp_diff": []}

    generate = SyncCBDriver.generate

    def recording_generate(driver, prompts, params=None, seed=None, **kwargs):
        flags = [m.training for m in driver.model.modules()]
        results = generate(driver, prompts, params, seed, **kwargs)
        record["seeds"] += [r.seed for r in results]
        record["driver_calls"].append({
            "prompts": [list(p) for p in prompts], "completions": [r.token_ids for r in results],
            "train_before": all(flags), "train_restored": [m.training for m in driver.model.modules()] == flags,
            "blocks_after_generate": driver.cache.num_blocks})
        return results

    SyncCBDriver.generate = recording_generate

    rollout = trainer._generate

    def recording_rollout(prompts):
        flags = [m.training for m in model.modules()]
        result = rollout(prompts)
        cache = trainer.cb_generation.driver.cache
        record["rollouts"].append({"prompts": list(prompts), "blocks_after_rollout": cache.num_blocks,
                                   "pools_after_rollout": len(cache.k_caches), "train_before": all(flags),
                                   "train_restored": [m.training for m in model.modules()] == flags})
        return result

    trainer._generate = recording_rollout

    score = trainer._generate_and_score_completions

    def recording_score(inputs):
        output = score(inputs)   # TRL's log of what every rank generated, gathered: this step's tail
        record["gathered"].append({"prompts": list(trainer._logs["prompt"])[-WORLD * PER_DEVICE:],
                                   "completions": list(trainer._logs["completion"])[-WORLD * PER_DEVICE:]})
        return output

    trainer._generate_and_score_completions = recording_score

    gather, add_gap, inside = trainer.accelerator.gather, trainer._logprob_gap.add, []

    def recording_gather(tensor):
        if inside:
            record["local_logp_diff"].append(tensor.reshape(-1).tolist())
        return gather(tensor)

    def recording_add_gap(*args):
        inside.append(True)
        try:
            add_gap(*args)
        finally:
            inside.clear()

    trainer.accelerator.gather, trainer._logprob_gap.add = recording_gather, recording_add_gap

    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer.train()
    final = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    record["log_history"] = trainer.state.log_history
    torch.save({"initial": initial, "final": final}, out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(record))


# -- the tests ----------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(num_processes: int, argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`accelerate launch --multi_gpu --num_processes N` (on a CPU: gloo) of argv, with this checkout on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(num_processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), *argv]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_grpo")
    start = time.perf_counter()
    accelerate_launch(WORLD, [__file__, str(out)])
    print(f"two-process GRPO run: {time.perf_counter() - start:.1f} s")
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    weights = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    assert [r["rank"] for r in records] == list(range(WORLD)) and all(r["world"] == WORLD for r in records)
    return records, weights


@pytest.mark.slow
def test_each_rank_generates_its_own_slice(ranks):
    from benchmarks.harness import make_tokenizer
    tokenizer = make_tokenizer(VOCAB)
    records, _ = ranks
    for rec in records:
        assert len(rec["rollouts"]) == len(rec["driver_calls"]) == STEPS   # one rollout, one driver call a step
    for step in range(STEPS):
        slices = [rec["rollouts"][step]["prompts"] for rec in records]
        calls = [rec["driver_calls"][step] for rec in records]
        gathered = records[0]["gathered"][step]
        assert all(rec["gathered"][step] == gathered for rec in records)
        # each driver got its rank's slice only, tokenised; the slices in rank order are the step's global batch
        for texts, call in zip(slices, calls):
            assert len(texts) == len(call["prompts"]) == PER_DEVICE
            assert call["prompts"] == [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        assert sum(slices, []) == gathered["prompts"]
        assert slices[0] != slices[1]
        counts = {p: gathered["prompts"].count(p) for p in gathered["prompts"]}
        assert set(counts.values()) == {NUM_GENERATIONS}   # whole groups, each generated once over the ranks
        # what TRL scored and trained on (gathered) is what the drivers generated
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for call in calls for ids in call["completions"]]
        assert texts == gathered["completions"]


@pytest.mark.slow
def test_samples_differ_within_and_across_ranks(ranks):
    records, _ = ranks
    seeds = [s for rec in records for s in rec["seeds"]]
    assert len(seeds) == WORLD * STEPS * PER_DEVICE and len(set(seeds)) == len(seeds), "a seed was drawn twice"
    spanning = 0
    for step in range(STEPS):
        calls = [rec["driver_calls"][step] for rec in records]
        groups: dict[tuple, list] = {}
        for rank, call in enumerate(calls):
            for prompt, completion in zip(call["prompts"], call["completions"]):
                groups.setdefault(tuple(prompt), []).append((rank, tuple(completion)))
        for members in groups.values():
            assert len(members) == NUM_GENERATIONS
            assert len({c for _, c in members}) == NUM_GENERATIONS, "identical samples in a group"
            spanning += len({r for r, _ in members}) > 1
    assert spanning == STEPS   # one group a step is split between the ranks (6 + 6 completions, groups of 4)


@pytest.mark.slow
def test_gradients_are_averaged(ranks):
    records, weights = ranks
    names = list(weights[0]["final"])
    assert names and all(list(w["final"]) == names for w in weights)
    for name in names:
        assert torch.equal(weights[0]["initial"][name], weights[1]["initial"][name])
        assert torch.equal(weights[0]["final"][name], weights[1]["final"][name]), f"replicas differ at {name}"
    assert any(not torch.equal(weights[0]["initial"][n], weights[0]["final"][n]) for n in names), "nothing trained"
    norms = [[e["grad_norm"] for e in rec["log_history"] if "grad_norm" in e] for rec in records]
    assert len(norms[0]) == STEPS and norms[0] == norms[1] and all(g > 0 for g in norms[0])


@pytest.mark.slow
def test_logprob_metric_is_gathered(ranks):
    records, _ = ranks
    logged = [[(e["sampling/sampling_logp_difference/mean"], e["sampling/sampling_logp_difference/max"])
               for e in rec["log_history"] if "sampling/sampling_logp_difference/mean" in e] for rec in records]
    assert len(logged[0]) == STEPS and logged[0] == logged[1]   # every rank logs the same, gathered values
    local = [rec["local_logp_diff"] for rec in records]   # per step: this rank's trainer - generator logprobs
    assert all(len(values) == STEPS for values in local)
    assert local[0] != local[1]                           # the ranks' own values differ
    for step, (mean, peak) in enumerate(logged[0]):
        delta = torch.tensor([v for values in local for v in values[step]])
        gap = delta[~torch.isnan(delta)].abs()            # NaN: the padding to the other rank's token count
        assert gap.numel() > len(local[0][step]) - 1
        assert mean == pytest.approx(gap.mean().item(), rel=1e-6, abs=1e-12) and peak == gap.max().item()
        assert 0.0 <= mean <= peak < 1e-3


@pytest.mark.slow
def test_train_mode_and_cache_release_per_rank(ranks):
    records, _ = ranks
    for rec in records:
        for call, rollout in zip(rec["driver_calls"], rec["rollouts"]):
            assert call["train_before"] and call["train_restored"]                # by the driver ...
            assert rollout["train_before"] and rollout["train_restored"]          # ... and after TRL's rollout
            assert call["blocks_after_generate"] > 0                       # the rollout held a cache ...
            assert rollout["blocks_after_rollout"] == 0 and rollout["pools_after_rollout"] == 0   # ... given back


@pytest.mark.parametrize("zero_stage, fsdp_version", [(3, None), (0, 1), (0, 2), (1, None), (2, None)])
def test_sharded_parameters_refused(tmp_path, monkeypatch, zero_stage, fsdp_version):
    import trl.trainer.grpo_trainer as grpo_trainer
    from trl import GRPOConfig
    from trl.distributed import DistributedBackend

    from cb_sync.integrations.trl import CBSyncGRPOTrainer

    class Reported(DistributedBackend):
        def __init__(self, accelerator):
            self.zero_stage, self.fsdp_version = zero_stage, fsdp_version

    monkeypatch.setattr(grpo_trainer, "DistributedBackend", Reported)
    tokenizer, model, dataset = build_parts()
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_steps=1,
                      report_to=[], use_cpu=True, bf16=False, save_strategy="no")

    def build():
        return CBSyncGRPOTrainer(model=model, reward_funcs=even_fraction, args=args, train_dataset=dataset,
                                 processing_class=tokenizer)

    if zero_stage == 3 or fsdp_version is not None:
        with pytest.raises(ValueError, match="does not support ZeRO-3 or FSDP"):
            build()
    else:
        assert build()._dist.zero_stage == zero_stage     # ZeRO-1/2 keep whole parameters on every rank


@pytest.mark.parametrize("asked", ["zero3", "fsdp_argument", "fsdp_launch"])
def test_sharded_parameters_refused_before_trl_builds_anything(tmp_path, monkeypatch, asked):
    """Where the arguments or `accelerate launch` already ask for sharded parameters, the trainer refuses before
    GRPOTrainer's own setup (loading models, a reference model's engine) runs."""
    import cb_sync.integrations.trl as cb_trl
    from cb_sync.integrations.trl import checks
    from trl import GRPOConfig, GRPOTrainer

    def trl_init(*args, **kwargs):
        raise AssertionError("GRPOTrainer.__init__ ran before the refusal")

    trl_init.__signature__ = inspect.signature(GRPOTrainer.__init__)    # the trainer reads GRPOConfig through it
    monkeypatch.setattr(GRPOTrainer, "__init__", trl_init)
    monkeypatch.setattr(checks, "is_deepspeed_zero3_enabled", lambda: asked == "zero3")
    if asked == "fsdp_launch":
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_steps=1,
                      report_to=[], use_cpu=True, bf16=False, save_strategy="no")
    if asked == "fsdp_argument":
        args.fsdp = True
    with pytest.raises(ValueError, match="does not support ZeRO-3 or FSDP"):
        cb_trl.CBSyncGRPOTrainer(model="unused", reward_funcs=even_fraction, args=args)


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
