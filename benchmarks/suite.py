"""The benchmark suite in one call, every part writing its results to --out.

On a GPU: Workload T (throughput with its peers), the decode-step probe, the driver-loop probe and Workload G
(GRPO with every backend, cb_sync's decode step compiled; needs trl and datasets). With --tiny, on the CPU in
about a minute: the parts that run there (throughput and GRPO on tiny models), which checks the plumbing, not
the speed.
    python -m benchmarks suite [--tiny] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import traceback
from pathlib import Path

from benchmarks.common import RESULTS

GPU_PARTS = (("throughput", []), ("decode_graphs", []), ("decode_loop", []), ("grpo", ["--cb-compile"]))
TINY_PARTS = (("throughput", ["--tiny"]), ("grpo", ["--tiny"]))


def main(argv=None) -> dict[str, str]:
    """Run every part in turn (one that fails is reported and the others still run); returns part -> "ok" or
    the error."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="CPU plumbing check on tiny models")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    outcome = {}
    for name, part_args in TINY_PARTS if args.tiny else GPU_PARTS:
        print(f"== {name} {' '.join(part_args)}", flush=True)
        try:
            importlib.import_module(f"benchmarks.{name}").main([*part_args, "--out", str(args.out)])
            outcome[name] = "ok"
        except (Exception, SystemExit) as error:        # argparse and failing runs exit: go on with the rest
            traceback.print_exc()
            outcome[name] = repr(error)[:300]
    print("\n".join(f"{name}: {result}" for name, result in outcome.items()))
    return outcome


if __name__ == "__main__":
    main()
