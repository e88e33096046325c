"""Where a profiled trainer step's GPU sits idle, and what the host was doing meanwhile. Reads a chrome trace of
torch.profiler (`export_chrome_trace`, optionally gzipped), so it runs on a trace taken on another machine.

    python -m benchmarks.step_timeline TRACE.json[.gz] [--top 20]

Per phase (the trainer methods `marked_phases` wraps in `record_function("phase:NAME")`, and the optimizer's own
annotation): calls, wall time, the GPU's busy time inside it and its idle share. Then the GPU's idle gaps of
MIN_GAP_US or more, each credited whole to the host's innermost phase and innermost op at the gap's midpoint (any
thread: the autograd engine runs the backward on its own), and the calls that may wait for the device (syncs, and
copies, which wait when they go to the host) by the outermost op that made them."""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

PHASE_PREFIX = "phase:"
TRAINER_PHASES = ("training_step", "_generate_and_score_completions", "_generate", "_calculate_rewards",
                  "_get_per_token_logps_and_entropies", "_compute_loss", "log")
ACCELERATOR_PHASES = ("backward", "clip_grad_norm_", "gather")
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
# runtime calls that may wait for the device: syncs, and copies (the trace does not say which go to the host)
WAITING_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                 "cudaMemcpyAsync"}
MIN_GAP_US = 5.0
NESTING_SLACK_US = 0.01     # a child op may end this much after its parent in the trace's rounding


@contextlib.contextmanager
def marked_phases(trainer):
    """Within the block, each of TRAINER_PHASES on `trainer` and ACCELERATOR_PHASES on its accelerator runs inside
    `torch.profiler.record_function("phase:NAME")`; the instances are left as they were, also on error."""
    import torch

    def marked(name, method):
        def call(*args, **kwargs):
            with torch.profiler.record_function(PHASE_PREFIX + name):
                return method(*args, **kwargs)
        return call

    targets = [(trainer, name) for name in TRAINER_PHASES] + [(trainer.accelerator, n) for n in ACCELERATOR_PHASES]
    missing = object()
    wrapped = []
    try:
        for owner, name in targets:
            if hasattr(owner, name):
                wrapped.append((owner, name, owner.__dict__.get(name, missing)))
                setattr(owner, name, marked(name, getattr(owner, name)))
        yield
    finally:
        for owner, name, before in wrapped:
            if before is missing:
                del owner.__dict__[name]
            else:
                setattr(owner, name, before)


@dataclass
class ThreadOps:
    """One host thread's ops, sorted by start, each with the index of the op that encloses it (-1: none)."""
    starts: list = field(default_factory=list)
    ends: list = field(default_factory=list)
    names: list = field(default_factory=list)
    parents: list = field(default_factory=list)

    @classmethod
    def of(cls, events: list[dict]) -> ThreadOps:
        ops, stack = cls(), []
        for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            start, end = e["ts"], e["ts"] + e["dur"]
            while stack and ops.ends[stack[-1]] < end - NESTING_SLACK_US:
                stack.pop()
            ops.starts.append(start)
            ops.ends.append(end)
            ops.names.append(e["name"])
            ops.parents.append(stack[-1] if stack else -1)
            stack.append(len(ops.starts) - 1)
        return ops

    def enclosing(self, t: float) -> list[int]:
        """The ops running at time t, innermost first."""
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0 and self.ends[i] < t:
            i = self.parents[i]
        chain = []
        while i >= 0:
            chain.append(i)
            i = self.parents[i]
        return chain


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def busy_within(busy: list[tuple[float, float]], start: float, end: float) -> float:
    """Microseconds of the merged intervals `busy` inside [start, end]."""
    i = max(bisect.bisect_right(busy, (start, float("inf"))) - 1, 0)
    total = 0.0
    while i < len(busy) and busy[i][0] < end:
        total += max(0.0, min(end, busy[i][1]) - max(start, busy[i][0]))
        i += 1
    return total


def phase_name(event: dict) -> str | None:
    name = event["name"]
    if name.startswith(PHASE_PREFIX):
        return name[len(PHASE_PREFIX):]
    if name.startswith("Optimizer.step#"):
        return "optimizer.step"
    return None


def summarize(events: list[dict], min_gap_us: float = MIN_GAP_US) -> dict:
    """The timeline's tables (see the module's docstring), in microseconds."""
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    host_ops = [e for e in events if e.get("cat") == "cpu_op"]
    phases = [(phase_name(e), e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("cat") == "user_annotation" and phase_name(e)]
    busy = merged([(e["ts"], e["ts"] + e["dur"]) for e in device])
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime")]
    window = (min(e["ts"] for e in host), max(e["ts"] + e["dur"] for e in host))
    threads = collections.defaultdict(list)
    for e in host_ops:
        threads[e["tid"]].append(e)
    ops = {tid: ThreadOps.of(evs) for tid, evs in threads.items()}

    def innermost_phase(t):
        inside = [(end - start, name) for name, start, end in phases if start <= t <= end]
        return min(inside)[1] if inside else "(no phase)"

    def innermost_op(t):
        found = []
        for thread in ops.values():
            chain = thread.enclosing(t)
            if chain:
                found.append((thread.ends[chain[0]] - thread.starts[chain[0]], thread.names[chain[0]]))
        return min(found)[1] if found else "(host between ops)"

    per_phase = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for name, start, end in phases:
        row = per_phase[name]
        row[0] += 1
        row[1] += end - start
        row[2] += busy_within(busy, start, end)
    edges = [window[0]] + [t for interval in busy for t in interval] + [window[1]]
    gaps = list(zip(edges[0::2], edges[1::2]))
    idle_by_phase, idle_by_op = collections.Counter(), collections.Counter()
    idle_total = 0.0
    for start, end in gaps:
        start, end = max(start, window[0]), min(end, window[1])
        if end - start < min_gap_us:
            continue
        idle_total += end - start
        middle = (start + end) / 2
        idle_by_phase[innermost_phase(middle)] += end - start
        idle_by_op[innermost_op(middle)] += end - start
    syncs = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cuda_runtime" and e["name"] in WAITING_CALLS:
            thread = ops.get(e["tid"])
            chain = thread.enclosing(e["ts"]) if thread else []
            waited_in = thread.names[chain[-1]] if chain else "(no op)"
            row = syncs[(e["name"], waited_in, innermost_phase(e["ts"]))]
            row[0] += 1
            row[1] += e["dur"]
    return {"wall_us": window[1] - window[0], "gpu_busy_us": busy_within(busy, *window), "idle_us": idle_total,
            "kernels": len(device), "phases": dict(per_phase), "idle_by_phase": dict(idle_by_phase),
            "idle_by_op": dict(idle_by_op), "syncs": {" | ".join(k): v for k, v in syncs.items()}}


def report(summary: dict, top: int = 20) -> str:
    ms = 1e-3
    lines = [f"step wall {summary['wall_us'] * ms:.1f} ms, GPU busy {summary['gpu_busy_us'] * ms:.1f} ms, idle "
             f"{summary['idle_us'] * ms:.1f} ms in gaps of {MIN_GAP_US:g} us or more, {summary['kernels']} device "
             "events", "",
             "phase | calls | wall ms | GPU busy ms | idle share"]
    for name, (calls, wall, busy) in sorted(summary["phases"].items(), key=lambda kv: -kv[1][1]):
        lines.append(f"{name} | {calls} | {wall * ms:.1f} | {busy * ms:.1f} | {1 - busy / max(wall, 1e-9):.0%}")
    for title, table in (("GPU idle by the host's innermost phase at each gap's midpoint", summary["idle_by_phase"]),
                         ("GPU idle by the host's innermost op at each gap's midpoint", summary["idle_by_op"])):
        lines += ["", f"{title} | ms"]
        lines += [f"{name} | {us * ms:.1f}" for name, us in sorted(table.items(), key=lambda kv: -kv[1])[:top]]
    lines += ["", "sync or copy call | op that made it | phase | calls | ms"]
    for key, (calls, us) in sorted(summary["syncs"].items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"{key} | {calls} | {us * ms:.1f}")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    print(report(summarize(load(args.trace)), args.top))


if __name__ == "__main__":
    main()
