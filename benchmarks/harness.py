"""What every workload shares: the Qwen3-shaped models with random weights (no download), an offline tokenizer,
cb_sync's modes, the decode roofline, timing, result files and tables, and engines run in processes of their own."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import functools
import gc
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).parent.parent       # the project tree: cb_sync/ and benchmarks/
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES = {  # Qwen3Config fields of each model shape; "tiny" is the CPU plumbing model
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
}
FULL_SIZE = dict(num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                 tie_word_embeddings=True, max_position_embeddings=40960)

# cb_sync's modes: engine name -> CBConfig fields (the exact mode cannot be compiled)
CB_MODES = {"cb_sync": {}, "cb_sync_compiled": {"compile": True}, "cb_sync_exact": {"batch_invariant": True}}

# decode roofline of the Qwen3-4B shape: bytes a step = weights + adapter + the batch's KV, read once
WEIGHT_BYTES = 8.06e9            # bf16, the 0.78 GB tied lm_head included
LORA_BYTES = 0.13e9              # r32 on all 7 projections
KV_BYTES_PER_TOKEN = 36 * 8 * 128 * 2 * 2
COPY_BANDWIDTHS = {"NVIDIA H200": 4.25e12, "NVIDIA H100 80GB HBM3": 3.0e12}   # device-to-device copies, measured


# -- the model and its tokenizer ----------------------------------------------------------------------------------

def model_config(shape: str = "qwen3-4b", tiny: bool = False):
    from transformers import Qwen3Config
    return Qwen3Config(**SHAPES["tiny"]) if tiny else Qwen3Config(**{**FULL_SIZE, **SHAPES[shape]})


def build_model(lora: bool, tiny: bool = False, device: str | None = None, dtype=None, shape: str = "qwen3-4b"):
    """The `shape` model with random weights (seed 0), EOS silenced, in eval mode: on the GPU in bf16, or (tiny) on
    the CPU in fp32. lora: PEFT r32 on all 7 projections, lora_B non-zero so that decode computes it."""
    from transformers import AutoModelForCausalLM
    device = device or ("cpu" if tiny else "cuda")
    dtype = dtype or (torch.float32 if tiny else torch.bfloat16)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(shape, tiny), dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    if lora:
        from peft import get_peft_model
        model = get_peft_model(model, lora_config(task_type=None))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 1e-3)
    return model.eval()


def lora_config(task_type: str | None = "CAUSAL_LM"):
    from peft import LoraConfig
    return LoraConfig(r=32, lora_alpha=64, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type=task_type)


TOKENIZER_WORDS = (["<pad>", "<eos>", "<bos>", "<think>", "</think>", "<answer>", "</answer>", "Solve", "the", "sum",
                    ".", ",", "Think", "between", "and", "then", "answer", "Q", "A", ":", "What", "is", "+", "?"]
                   + [str(d) for d in range(10)])


def make_tokenizer(vocab_size: int):
    """A word-level tokenizer over ids 0..vocab_size-1, built offline: the special tokens and the words of the
    synthetic prompts first, then t<id> for every other id of the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(TOKENIZER_WORDS)}
    vocab.update({f"t{i}": i for i in range(len(TOKENIZER_WORDS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # the tags stay ordinary tokens: TRL decodes completions with skip_special_tokens=True
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def random_prompts(vocab_size: int, batches: list[int], prompt_len: int) -> dict[int, list[list[int]]]:
    """The random prompts of every batch size, the same for every engine and process."""
    gen = torch.Generator().manual_seed(0)
    return {batch: torch.randint(0, vocab_size, (batch, prompt_len), generator=gen).tolist() for batch in batches}


def cb_config(engine: str, **fields):
    """The CBConfig of one of cb_sync's modes (CB_MODES), with `fields`."""
    from cb_sync import CBConfig
    return CBConfig(**{**CB_MODES[engine], **fields})


def mode_flags(engine: str) -> dict:
    """A row's mode flags: whether cb_sync's decode step was compiled and whether it ran in the exact mode."""
    if engine not in CB_MODES:
        return {}
    return {"cb_compiled": bool(CB_MODES[engine].get("compile")),
            "cb_batch_invariant": bool(CB_MODES[engine].get("batch_invariant"))}


# -- the roofline and timing --------------------------------------------------------------------------------------

@functools.cache
def copy_bandwidth() -> float:
    """This card's copy bandwidth (COPY_BANDWIDTHS by its name, else measured: a 256 MiB copy, the best of 5; call
    it before the card fills up); without a GPU, the H200's."""
    if not torch.cuda.is_available():
        return COPY_BANDWIDTHS["NVIDIA H200"]
    name = torch.cuda.get_device_name()
    if name in COPY_BANDWIDTHS:
        return COPY_BANDWIDTHS[name]
    source = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * source.numel() / min(cuda_seconds(lambda: target.copy_(source)) for _ in range(5))


def floor_seconds(kv_bytes: float, lora: bool) -> float:
    """A decode step at its floor: the weights (+ adapter) and kv_bytes of KV read once."""
    return (WEIGHT_BYTES + (LORA_BYTES if lora else 0) + kv_bytes) / copy_bandwidth()


def floor_seconds_per_step(batch: int, context: int, lora: bool) -> float:
    return floor_seconds(KV_BYTES_PER_TOKEN * batch * context, lora)


def call_floor_seconds(batch: int, prompt_len: int, new_tokens: int, lora: bool) -> float:
    """A whole call's decode floor: its steps' floors summed (the KV term grows linearly with the step)."""
    return new_tokens * floor_seconds_per_step(batch, prompt_len + new_tokens // 2, lora)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cuda_seconds(fn) -> float:
    """Wall seconds of fn(), the device synchronised before and after."""
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start


def timed(fn) -> tuple[float, float, float]:
    """Seconds, peak GiB of GPU memory (0 on the CPU) and seconds of garbage-collector pauses of fn()."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with gc_pauses() as pauses:
        seconds = cuda_seconds(fn)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    return seconds, peak, sum(s for _, s in pauses)


@contextlib.contextmanager
def profiled(path: Path, cuda: bool, rows: int = 40):
    """torch.profiler over the block; its busiest ops (by their own device time where cuda, else their own host time)
    as torch's table at path: where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=90) + "\n")


@contextlib.contextmanager
def gc_pauses():
    """A list that holds every run of the cyclic garbage collector within the block as it ends: (its start in
    perf_counter seconds, its seconds)."""
    pauses, started = [], []

    def callback(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            start = started.pop()
            pauses.append((start, time.perf_counter() - start))
    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


def process_age_s() -> float:
    """Seconds since this process started (Linux: its start time in /proc, 10 ms resolution; elsewhere since this
    module was imported)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")      # field 22: start time, clock ticks after boot
        return max(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 0.0)
    except (OSError, IndexError, ValueError, AttributeError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()
PROCESS_START = _IMPORTED - process_age_s()      # perf_counter's reading when this process started


def since_process_start() -> float:
    return time.perf_counter() - PROCESS_START


def graph_us(step, launches: int, replays: int = 3) -> float:
    """Microseconds a call of step(), captured `launches` times in one CUDA graph and replayed (no launch cost)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / (replays * launches)


def free_cached_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- the card, the versions, the result files ---------------------------------------------------------------------

def gpu_state() -> dict:
    """The card's name, temperature (C), SM clock (MHz) and power (W) now, from nvidia-smi; {} without it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,temperature.gpu,clocks.sm,power.draw",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10).stdout
        name, *values = out.splitlines()[0].split(", ")
    except (OSError, IndexError, subprocess.SubprocessError):
        return {}
    try:
        return {"gpu": name, **dict(zip(("gpu_c", "sm_mhz", "gpu_w"), map(float, values)))}
    except ValueError:                  # a reading nvidia-smi gives as [N/A]
        return {"gpu": name}


def commit(root: Path = ROOT) -> str:
    """What was run, from the project tree at `root`: the commit of its checkout, "+changes" where tracked files
    differ from it (the code measured is not that commit's); "files:<sha256 prefix>" of its package and benchmark
    sources where `root` is not the top of a git checkout that tracks them (a copy inside another repository, whose
    commit would name other code, or no repository at all)."""
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=root)
    try:
        top = git("rev-parse", "--show-toplevel").stdout.strip()
        head = git("rev-parse", "--short", "HEAD").stdout.strip()
        if head and Path(top).resolve() == root.resolve() and git("ls-files", "cb_sync", "benchmarks").stdout:
            return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no").stdout else "")
    except (OSError, subprocess.SubprocessError):
        pass
    digest = hashlib.sha256()
    for path in sorted(p for folder in ("cb_sync", "benchmarks") for p in (root / folder).rglob("*.py")):
        digest.update(f"{path.relative_to(root).as_posix()}\n".encode() + path.read_bytes())
    return f"files:{digest.hexdigest()[:12]}"


def environment() -> dict:
    """The card, the commit, the versions of the stack and the time, in every row."""
    versions = {}
    for package in ("torch", "transformers", "triton", "peft", "trl", "vllm", "unsloth"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"card": card, "commit": commit(), **versions,
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def caption(rows: list[dict]) -> str:
    """The cards, dates and commits the rows ran on, in a line under a table."""
    def values(key, cut=None):
        return ", ".join(sorted({str(r[key])[:cut] for r in rows if r.get(key)})) or "-"
    return f"Card: {values('card')}; date: {values('timestamp', 10)}; commit: {values('commit')}.\n"


def write_results(name: str, rows: list[dict], table: str, out_dir: Path) -> None:
    """<out_dir>/<name>.json (a row an object; rows measured here get the environment) and <name>.md (the table
    and the line naming card, date and commit)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    rows = [row if "timestamp" in row else {**row, **env} for row in rows]
    (out_dir / f"{name}.json").write_text(json.dumps(rows, indent=1))
    (out_dir / f"{name}.md").write_text(f"{table.rstrip()}\n\n{caption(rows)}")


def read_rows(paths) -> list[dict]:
    return [row for path in paths for row in json.loads(Path(path).read_text())]


def exit_code(rows: list[dict] | None) -> int:
    """1 where a row holds an error instead of a measurement (a script running stages reports it), else 0."""
    return int(any("error" in row for row in rows or []))


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]) + "\n"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a < 10 * b else f"{a / b:.1f}x"


def pyplot():
    """matplotlib's pyplot drawing to files, or None where matplotlib is not installed (plots are then skipped)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def bar_chart(series: dict[str, dict[int, float]], path: Path, title: str, log_scale: bool = False) -> None:
    """Generated tokens / s: a group a batch size, a bar a series (label -> {batch: tok/s})."""
    plt = pyplot()
    if plt is None:
        return
    batches = sorted({batch for values in series.values() for batch in values})
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, (label, values) in enumerate(series.items()):
        xs = [x for x, batch in enumerate(batches) if batch in values]
        ax.bar([x + i * width for x in xs], [values[batches[x]] for x in xs], width, label=label)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_yscale("log" if log_scale else "linear")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- engines in processes of their own ----------------------------------------------------------------------------

def card_memory() -> tuple[float, float] | None:
    """(GiB in use, GiB in all) on the first GPU, every process's: nvidia-smi, else torch where CUDA is started."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        used, total = (float(value) / 1024 for value in out.splitlines()[0].split(","))
        return round(used, 2), round(total, 2)
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        pass
    if "torch" not in sys.modules or not torch.cuda.is_initialized():
        return None
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 2**30, 2), round(total / 2**30, 2)


@dataclasses.dataclass
class ChildOutcome:
    returncode: int | None
    timed_out: bool
    tail: list[str]                 # the last lines it printed
    card_released: bool | None      # the card's memory came back to its level before the start (None: no GPU)

    def reason(self, timeout: float | None = None) -> str:
        """Why a row it should have written is missing, in a line."""
        if self.timed_out:
            return f"stopped at its time limit ({timeout:.0f} s) before writing this row"
        last = next((line for line in reversed(self.tail) if line.strip()), "no output")
        return f"its process exited with code {self.returncode} without this row; last output: {last[:500]}"


def run_child(command: list[str], timeout: float | None = None, env: dict | None = None) -> ChildOutcome:
    """Run command in a process group of its own, echoing its output. Past `timeout` seconds (or when this process
    is interrupted) it gets SIGINT, so that it can save what it measured, then SIGTERM. Whatever its group still runs
    afterwards (an engine's workers) is ended, and the call waits until the card's memory is back."""
    before = card_memory()
    # SIGINT at its default in the child: a shell that starts this process in the background ignores it
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env=env, process_group=0,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    tail: collections.deque[str] = collections.deque(maxlen=40)

    def pump():
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n"))
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _interrupt(proc)
    except BaseException:
        _interrupt(proc)
        end_group(proc)
        raise
    end_group(proc)
    reader.join(timeout=10)
    return ChildOutcome(proc.returncode, timed_out, list(tail), _wait_for_release(before))


def _interrupt(proc: subprocess.Popen) -> None:
    _signal_group(proc.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def end_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds, to every process left in proc's process group; reap proc."""
    if _signal_group(proc.pid, signal.SIGTERM):
        stop = time.monotonic() + grace
        while time.monotonic() < stop and _signal_group(proc.pid, 0):
            if proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.5)
            else:
                time.sleep(0.5)
        _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def _wait_for_release(before: tuple[float, float] | None, timeout: float = 60.0, slack_gib: float = 1.0):
    if before is None:
        return None
    stop = time.monotonic() + timeout
    while (now := card_memory()) is not None and now[0] > before[0] + slack_gib:
        if time.monotonic() > stop:
            print(f"warning: the card still has {now[0]} GiB in use, {before[0]} GiB before the child", flush=True)
            return False
        time.sleep(1.0)
    return True


def run_engines(engines: list[str], command, expected, out: Path, name: str, time_limit: float | None,
                merge=None) -> list[dict]:
    """Each engine in a process of its own, one after the other, within `time_limit` seconds in all:
    command(engine, part name, seconds left) starts it, writing <out>/<part>.json; expected(engine) lists the rows it
    should write. A row it did not write carries the reason; merge(rows), if given, after every engine."""
    stop = None if time_limit is None else time.monotonic() + time_limit
    rows = []
    for engine in engines:
        part = f"{name}_{engine}"
        left = None if stop is None else stop - time.monotonic()
        if left is not None and left <= 0:
            rows += [{**row, "error": "not run: the run's --time-limit was used up"} for row in expected(engine)]
            continue
        outcome = run_child(command(engine, part, left), timeout=left)
        path = out / f"{part}.json"
        got = [{**row, "process": "own"} for row in json.loads(path.read_text())] if path.is_file() else []
        for suffix in (".json", ".md", ".png"):
            (out / f"{part}{suffix}").unlink(missing_ok=True)
        keys = {row_key(row) for row in got}
        printed = {line.split(" failed: ")[0]: line for line in outcome.tail if " failed: " in line}
        for row in expected(engine):
            if row_key(row) not in keys:
                label = f"{engine} batch {row['batch']}"
                got.append({**row, "process": "own", "error": printed.get(label, outcome.reason(left))})
        rows += got
        if merge is not None:
            merge(rows)
    return rows


def row_key(row: dict) -> tuple:
    """What a row measured: its engine, adapter and workload, and cb_sync's KV cap and attention backend."""
    return (row["engine"], row.get("lora"), row["batch"], row.get("sampler"), row.get("prompt_len"),
            row.get("new_tokens"), row.get("max_cache_gib"), row.get("attn_backend"))
