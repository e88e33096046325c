"""Benchmark rows measured in processes of their own: run one with a time limit, end whatever its process group
left running, wait until the card's memory is back, and read the card's memory in use (the pools of engines such
as vLLM are not in torch's counters)."""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time


def card_memory() -> tuple[float, float] | None:
    """(GiB in use, GiB in all) on the first GPU, for every process on it: nvidia-smi, else torch.cuda.mem_get_info
    where this process has started CUDA already; None otherwise."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        used, total = (float(value) / 1024 for value in out.splitlines()[0].split(","))
        return round(used, 2), round(total, 2)
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        pass
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 2**30, 2), round(total / 2**30, 2)


@dataclasses.dataclass
class ChildOutcome:
    returncode: int | None
    timed_out: bool
    seconds: float
    tail: list[str]                 # the last lines it printed
    card_released: bool | None      # the card came back to what was in use before it started (None: no GPU)

    def reason(self, timeout: float | None = None) -> str:
        """Why a row it should have written is missing, in a line."""
        if self.timed_out:
            return f"stopped at its time limit ({timeout:.0f} s) before writing this row"
        last = next((line for line in reversed(self.tail) if line.strip()), "no output")
        return f"its process exited with code {self.returncode} without this row; last output: {last[:500]}"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_child(command: list[str], timeout: float | None = None, env: dict | None = None, tail_lines: int = 40,
              release_timeout: float = 60.0) -> ChildOutcome:
    """Run command in a process group of its own (same session: whatever outlives this process still ends with the
    command that started it), echoing its output; past `timeout` seconds, or when this process is interrupted, it is
    interrupted too (SIGINT, so a benchmark can save what it measured), then terminated. Whatever the group still
    runs afterwards (an engine's worker, say) is ended too, and the call waits until the card's memory in use is
    back to its level before the start."""
    before = card_memory()
    start = time.monotonic()
    # SIGINT as the default in the child: a shell that starts this process in the background ignores it, and the
    # child would inherit that and see no interruption until it is terminated
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env=env, process_group=0, preexec_fn=_default_sigint)
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)

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
    seconds = time.monotonic() - start
    return ChildOutcome(proc.returncode, timed_out, seconds, list(tail), _wait_for_release(before, release_timeout))


def _interrupt(proc: subprocess.Popen, wait: float = 30.0) -> None:
    _signal_group(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        pass


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
                try:
                    proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pass
            else:
                time.sleep(0.5)
        _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def _wait_for_release(before: tuple[float, float] | None, timeout: float, slack_gib: float = 1.0) -> bool | None:
    if before is None:
        return None
    stop = time.monotonic() + timeout
    while True:
        now = card_memory()
        if now is None or now[0] <= before[0] + slack_gib:
            return True
        if time.monotonic() > stop:
            print(f"warning: the card still has {now[0]} GiB in use, {before[0]} GiB before the child", flush=True)
            return False
        time.sleep(1.0)
