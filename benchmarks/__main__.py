"""python -m benchmarks <workload> [args...]: run a workload's benchmark (its --help tells the rest).

    python -m benchmarks throughput ...       Workload T, and the exact mode's logprob gap (--logprob-gap)
    python -m benchmarks grpo ...             Workloads G and G2 (--workload G2)
    python -m benchmarks long_rollouts ...    Workload L, and a KV cap's predicted cost (--predict-caps)
    python -m benchmarks long_attention ...   Workload L's attention kernels against their roofline
    python -m benchmarks all [--tiny] [--out DIR]   T and G one after the other (--tiny: on the CPU, the plumbing)
"""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path

WORKLOADS = ("throughput", "grpo", "long_rollouts", "long_attention")
ALL = {"throughput": [], "grpo": []}       # `all`: each with --tiny and --out DIR/<workload> where given


def run_all(argv: list[str]) -> dict[str, str]:
    """Every part of `ALL` in turn (one that fails is reported, the others still run): part -> "ok" or its error."""
    out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else None
    outcome = {}
    for name, part_args in ALL.items():
        print(f"== {name}", flush=True)
        args = [*part_args, *(["--tiny"] if "--tiny" in argv else []), *(["--out", str(out / name)] if out else [])]
        try:
            importlib.import_module(f"benchmarks.{name}").main(args)
            outcome[name] = "ok"
        except (Exception, SystemExit) as error:        # argparse and failing runs exit: go on with the rest
            traceback.print_exc()
            outcome[name] = repr(error)[:300]
    print("\n".join(f"{name}: {result}" for name, result in outcome.items()))
    return outcome


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["all"]:
        return run_all(argv[1:])
    if not argv or argv[0] not in WORKLOADS:
        print(__doc__)
        raise SystemExit(0 if not argv or argv[0] in ("-h", "--help") else 2)
    sys.argv = [f"python -m benchmarks {argv[0]}", *argv[1:]]
    return importlib.import_module(f"benchmarks.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    main()
