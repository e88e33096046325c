"""LoRA projections of a whole decoder stack: microseconds per layer for the four groups of a Qwen3-4B layer
(q/k/v, o, gate/up, down; bf16 weights, fp32 adapters r32) as `kernels.lora_linear_group` runs them, over 36
layers of weights streamed from HBM (not L2-resident as in `benchmarks.lora_kernel`), timed as CUDA-graph replays.
Variants run in one process, alternating, so they compare in the same run:
  cublas                 torch's base GEMMs alone (no LoRA): the reference
  kernels                cb_sync's kernels as they are
  kernels:name=V,...     the same with LoraTuning fields set (e.g. large_rows=64,summed_base_block_n=32; PDL=0:
                         no programmatic dependent launch)
  other[:name=V,...]     the kernels module at --other (e.g. `git show REV:cb_sync/lora/kernels.py`)
    python -m benchmarks.lora_layers [--rows 4 32 128] [--variants cublas kernels kernels:PDL=0] [--other FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util

import torch

from benchmarks.common import graph_us, markdown_table, write_results
from cb_sync.lora import kernels
from cb_sync.tuning import LoraTuning

LAYERS = 36
GROUPS = {"qkv": (2560, [4096, 1024, 1024]), "o": (4096, [2560]), "gate/up": (2560, [9728, 9728]),
          "down": (9728, [2560])}


def _stack(k: int, widths: list[int]) -> list[dict]:
    """LAYERS layers of one group's weights and fp32 adapters (B scaled small, as a trained adapter's)."""
    return [{"weights": [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n in widths],
             "as": [torch.randn(32, k, device="cuda") * 0.02 for _ in widths],
             "bs": [torch.randn(n, 32, device="cuda") * 1e-3 for n in widths]} for _ in range(LAYERS)]


def _group_call(module, variant: str, tuning: LoraTuning):
    """fn(x, layer) running one group's projections as the variant does."""
    if variant == "cublas":
        return lambda x, layer: [torch.nn.functional.linear(x, w) for w in layer["weights"]]
    own = {"tuning": tuning} if module is kernels else {}      # another revision's module keeps its own tiles
    return lambda x, layer: module.lora_linear_group(x, layer["weights"], [], layer["as"], layer["bs"],
                                                     [2.0] * len(layer["weights"]), **own)


@contextlib.contextmanager
def _variant(module, settings: str):
    """The LoraTuning of "name=V,..." (PDL=0 also turns the module's programmatic dependent launch off until the
    block ends)."""
    values = dict(item.split("=") for item in settings.split(",") if item)
    pdl = values.pop("PDL", "1") == "1"
    saved_pdl = getattr(module, "_pdl", None)
    if not pdl and saved_pdl is not None:
        module._pdl = lambda device: False
    try:
        yield dataclasses.replace(LoraTuning(), **{name: int(value) for name, value in values.items()})
    finally:
        if saved_pdl is not None:
            module._pdl = saved_pdl


def _us_per_layer(fn, repeats: int = 10) -> float:
    """Mean microseconds per layer of fn (all LAYERS layers) captured in one CUDA graph."""
    with torch.no_grad():
        return graph_us(fn, 1, repeats) / LAYERS


def _load_module(path: str):
    spec = importlib.util.spec_from_file_location("other_lora_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 16, 32, 64])
    parser.add_argument("--variants", nargs="+", default=["cublas", "kernels", "kernels:PDL=0"])
    parser.add_argument("--other", help="a kernels module file for the `other` variant")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", default="lora_layers")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    other = _load_module(args.other) if args.other else None
    modules = {v: other if v.startswith("other") else kernels for v in args.variants}
    stacks = {group: _stack(k, widths) for group, (k, widths) in GROUPS.items()}
    rows = []
    for m in args.rows:
        xs = {group: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for group, (k, _) in GROUPS.items()}
        times = {}
        for _ in range(args.rounds):
            for variant in args.variants:
                with _variant(modules[variant], variant.partition(":")[2]) as tuning:
                    call = _group_call(modules[variant], variant, tuning)
                    for group in GROUPS:
                        fn = lambda g=group: [call(xs[g], layer) for layer in stacks[g]]
                        times.setdefault((variant, group), []).append(_us_per_layer(fn))
        for variant in args.variants:
            per_group = {group: round(min(times[variant, group]), 1) for group in GROUPS}
            rows.append({"engine": "cb_sync", "model": "qwen3-4b-shape", "variant": variant, "rows": m,
                         "us_per_layer": per_group, "us_per_layer_total": round(sum(per_group.values()), 1),
                         "spread_us": {g: round(max(t) - min(t), 1) for (v, g), t in times.items() if v == variant}})
            print(rows[-1], flush=True)
    table = markdown_table(["rows", "variant", *GROUPS, "sum us/layer"],
                           [[r["rows"], r["variant"], *r["us_per_layer"].values(), r["us_per_layer_total"]]
                            for r in rows])
    write_results(args.name, rows, table)
    print(table)


if __name__ == "__main__":
    main()
