"""LoRA micro-benchmark: microseconds per projection for PEFT's forward and for cb_sync's Triton LoRA kernel,
at the Qwen3-4B projection shapes (bf16 base, fp32 adapter r32 as PEFT makes it), timed as CUDA-graph replays
so that launch latency counts as it does in a captured decode step. The kernel is also timed alone at each
shrink tile (input features per program / per load) of `--tiles`. Operands here stay in L2 across the
repeats, unlike in a decode step: choose tiles by the decode step's time (benchmarks/NOTES.md, attempt 6).
The LoRA columns are the forward's time over the base GEMM alone; where the kernel computes the base GEMM itself
(wide projections, few rows) that difference also holds the kernel's GEMM against cuBLAS's, and can be negative.
    python -m benchmarks.lora_kernel [--rows 1 4 32 128] [--tiles 256/64 64/64 128/128 256/256]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import markdown_table, write_results
from cb_sync.lora import kernels, lora_kernels

SHAPES = {"q": (2560, 4096), "k/v": (2560, 1024), "o": (4096, 2560), "gate/up": (2560, 9728), "down": (9728, 2560)}


def _lora_linear(in_features: int, out_features: int):
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=False)),
                           LoraConfig(r=32, lora_alpha=64, target_modules=["0"], init_lora_weights=False))
    model = model.to("cuda", torch.bfloat16)
    for name, p in model.named_parameters():     # PEFT's default on a bf16 model: the adapter in fp32
        if "lora_" in name:
            p.data = p.data.float()
    return model.eval(), model.base_model.model[0]


def _us_per_call(fn, repeats: int = 50) -> float:
    """Mean microseconds of fn inside a CUDA graph of `repeats` calls."""
    with torch.no_grad():
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(repeats):
                fn()
        graph.replay()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
    return 1000 * start.elapsed_time(stop) / repeats


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32, 128])
    parser.add_argument("--tiles", nargs="+", default=["256/64", "64/64", "128/128", "256/256"],
                        help="shrink tiles: SPLIT/BLOCK (input features per program / per load)")
    parser.add_argument("--name", default="lora_kernel")
    args = parser.parse_args(argv)
    tiles = {tile: [int(v) for v in tile.split("/")] for tile in args.tiles}
    rows = []
    for label, (k, n) in SHAPES.items():
        model, layer = _lora_linear(k, n)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = _us_per_call(lambda: layer.base_layer(x))
            peft = _us_per_call(lambda: layer(x))
            with lora_kernels(model):
                kernel = _us_per_call(lambda: layer(x))
            y = layer.base_layer(x)
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            alone = {tile: round(_us_per_call(lambda: kernels.lora_add(x, y, a, b, 2.0, None, *split)), 1)
                     for tile, split in tiles.items()}
            rows.append({"engine": "cb_sync", "model": "qwen3-4b-shape", "projection": label, "in": k, "out": n,
                         "rows": m, "base_us": round(base, 1), "peft_lora_us": round(peft - base, 1),
                         "kernel_lora_us": round(kernel - base, 1), "kernel_alone_us_by_tile": alone})
            print(rows[-1], flush=True)
    table = markdown_table(
        ["projection", "rows", "base GEMM us", "LoRA us, PEFT", "LoRA us over the base, kernel"]
        + [f"kernel alone us, tile {tile}" for tile in tiles],
        [[r["projection"], r["rows"], r["base_us"], r["peft_lora_us"], r["kernel_lora_us"],
          *r["kernel_alone_us_by_tile"].values()] for r in rows])
    write_results(args.name, rows, table)
    print(table)


if __name__ == "__main__":
    main()
