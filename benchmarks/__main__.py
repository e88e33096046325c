"""python -m benchmarks <script> [args...]: run benchmarks/<script>.py's main() with the remaining arguments.

    python -m benchmarks grpo --tiny
    python -m benchmarks throughput --batches 4 32
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

NOT_SCRIPTS = {"common", "grpo_stats", "grpo_report", "grpo_workload", "grpo_peers", "grpo_unsloth", "isolation",
               "peers_vllm"}


def scripts() -> list[str]:
    return sorted(p.stem for p in Path(__file__).parent.glob("*.py")
                  if not p.stem.startswith("_") and p.stem not in NOT_SCRIPTS)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    names = scripts()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in names:
        print(__doc__ + "\nscripts: " + ", ".join(names))
        raise SystemExit(0 if not argv or argv[0] in ("-h", "--help") else 2)
    module = importlib.import_module(f"benchmarks.{argv[0]}")
    if not hasattr(module, "main"):
        raise SystemExit(f"benchmarks.{argv[0]} has no main()")
    sys.argv = [f"python -m benchmarks {argv[0]}", *argv[1:]]
    module.main(argv[1:])


if __name__ == "__main__":
    main()
