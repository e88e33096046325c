"""Shared benchmark pieces: the Qwen3-4B- and Qwen3-1.7B-shaped models, the roofline, and the result files."""

from __future__ import annotations

import datetime
import functools
import json
import subprocess
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
WEIGHT_BYTES = 8.06e9          # Qwen3-4B bf16 incl. the 0.78 GB tied lm_head
LORA_BYTES = 0.13e9
KV_BYTES_PER_TOKEN = 36 * 8 * 128 * 2 * 2
# a device-to-device copy's bytes read and written a second, by the card's name: the H200's as measured on ours (the
# roofline of NOTES.md), the 80 GB SXM H100's as measured on the H100s lent to this project (~3.0 TB/s)
COPY_BANDWIDTHS = {"NVIDIA H200": 4.25e12, "NVIDIA H100 80GB HBM3": 3.0e12}


def qwen3_4b_config(tiny: bool = False):
    from transformers import Qwen3Config
    if tiny:
        return Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return Qwen3Config(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, max_position_embeddings=40960)


def qwen3_1_7b_config(tiny: bool = False):
    from transformers import Qwen3Config
    if tiny:
        return qwen3_4b_config(tiny=True)
    return Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, max_position_embeddings=40960)


MODEL_CONFIGS = {"qwen3-4b": qwen3_4b_config, "qwen3-1.7b": qwen3_1_7b_config}


def build_model(lora: bool, tiny: bool = False, device: str = "cuda", dtype=torch.bfloat16, shape: str = "qwen3-4b"):
    """The benchmark model (`shape`: a key of MODEL_CONFIGS; tiny: the 2-layer one) with random weights, built on the
    device; LoRA r32 on all 7 projections."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(MODEL_CONFIGS[shape](tiny), dtype=dtype, attn_implementation="sdpa")
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 1e-3)
        model.eval()
    return model


def floor_seconds_per_step(batch: int, context: int, lora: bool) -> float:
    """Bandwidth floor of one decode step: weights (+ adapter) + the batch's KV read once."""
    return floor_seconds(KV_BYTES_PER_TOKEN * batch * context, lora)


def floor_seconds(kv_bytes: float, lora: bool) -> float:
    """Bandwidth floor of one decode step that reads kv_bytes of KV: those and the weights (+ adapter), once."""
    return (WEIGHT_BYTES + (LORA_BYTES if lora else 0) + kv_bytes) / copy_bandwidth()


@functools.cache
def copy_bandwidth() -> float:
    """The copy bandwidth of this process's card (`COPY_BANDWIDTHS`, by its name); another card's is measured here
    (a 256 MiB device-to-device copy, the best of 5: call it before the card fills up); without a GPU, the H200's
    (what CPU replays predict for)."""
    if not torch.cuda.is_available():
        return COPY_BANDWIDTHS["NVIDIA H200"]
    name = torch.cuda.get_device_name()
    if name in COPY_BANDWIDTHS:
        return COPY_BANDWIDTHS[name]
    source = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    seconds = min(cuda_seconds(lambda: target.copy_(source)) for _ in range(5))
    return 2 * source.numel() / seconds


def cuda_seconds(fn) -> float:
    """Wall seconds of fn(), the device (where there is one) synchronised before and after."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def graph_us(step, launches: int, replays: int) -> float:
    """Microseconds per call of step(), run once, then captured `launches` times in one CUDA graph and timed over
    `replays` replays of it (no host launch cost in the time)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / (replays * launches)


def grouped_bars(series: dict[str, dict[int, float]], path, title: str, log_scale: bool = False,
                 width_inches: float = 10) -> None:
    """A bar chart of generated tokens / s: one group a batch size, one bar a series (label -> {batch: tok/s}), in the
    order given; skipped without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    batches = sorted({batch for values in series.values() for batch in values})
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(width_inches, 4.5))
    for i, (label, values) in enumerate(series.items()):
        xs = [x for x, batch in enumerate(batches) if batch in values]
        ax.bar([x + i * width for x in xs], [values[batches[x]] for x in xs], width, label=label)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(batches))], [f"batch {b}" for b in batches])
    if log_scale:
        ax.set_yscale("log")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def gpu_state() -> dict:
    """The card's name, temperature (C), SM clock (MHz) and power draw (W) now, from nvidia-smi; {} where it is
    absent."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,temperature.gpu,clocks.sm,power.draw",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout
        name, *values = out.splitlines()[0].split(", ")
    except (OSError, IndexError, subprocess.SubprocessError):
        return {}
    try:
        temperature, clock, power = (float(value) for value in values)
    except ValueError:                  # a reading nvidia-smi gives as [N/A]
        return {"gpu": name}
    return {"gpu": name, "gpu_c": temperature, "sm_mhz": clock, "gpu_w": power}


def environment() -> dict:
    import transformers
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"card": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "triton": triton_version,
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write_results(name: str, rows: list[dict], table: str, out_dir: Path = RESULTS) -> None:
    """benchmarks/results/<name>.json (one object per row, with the environment) and <name>.md (the table)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    (out_dir / f"{name}.json").write_text(json.dumps([{**row, **env} for row in rows], indent=1))
    (out_dir / f"{name}.md").write_text(table)


def exit_code(rows: list[dict] | None) -> int:
    """A benchmark's exit status: 1 where a row holds an error instead of a measurement (so that a script running
    stages on a GPU machine reports it), else 0."""
    return int(any("error" in row for row in rows or []))


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
