"""Decode-step probe: milliseconds per pure-decode step per bucket, eager vs graph replay (vs compiled graph),
with and without LoRA, and % of the bandwidth floor. Every row of the batch has a 384-token context.
    python -m benchmarks.decode_graphs [--batches 4 32 128] [--compile]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import build_model, floor_seconds_per_step, markdown_table, write_results
from cb_sync import CBConfig, SamplingParams, SyncCBDriver
from cb_sync.graphs.decode_graphs import GREEDY
from cb_sync.model_state import generation_mode

CONTEXT = 384


def _ms_per_call(fn, repeats: int = 20) -> float:
    fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / repeats


def probe(model, batch: int, compile_model: bool) -> dict:
    """Fill the static buffers with `batch` rows at context CONTEXT and time eager step vs replay."""
    driver = SyncCBDriver(model, CBConfig(max_batch_size=batch, max_batch_tokens=8192, compile=compile_model))
    driver.generate([[1] * (CONTEXT - 4)] * batch, SamplingParams(max_new_tokens=4))   # cache + capture
    graphs, per_row = driver.graphs, -(-CONTEXT // driver.cache.block_size)
    with generation_mode(model):
        rows = torch.arange(batch, device="cuda")
        graphs.tables[:batch, :per_row] = (rows[:, None] * per_row + torch.arange(per_row, device="cuda")).int()
        graphs.positions[0, :batch] = CONTEXT - 1
        graphs.seq_lens[:batch] = CONTEXT
        graphs.slots[:batch] = graphs.tables[:batch, (CONTEXT - 1) // 16].long() * 16 + (CONTEXT - 1) % 16
        eager = _ms_per_call(lambda: graphs.step(batch, GREEDY), repeats=5)
        replay = _ms_per_call(graphs.graphs[(batch, GREEDY)].replay)
    driver.release()
    return {"eager_ms": round(eager, 2), "graph_ms": round(replay, 2)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 32, 128])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--name", default="decode_graphs")
    args = parser.parse_args(argv)
    model = build_model(lora=True)
    rows = []
    for batch in args.batches:
        for lora in (True, False):
            if lora:
                times = probe(model, batch, args.compile)
            else:
                with model.disable_adapter():
                    times = probe(model, batch, args.compile)
            floor_ms = 1e3 * floor_seconds_per_step(batch, CONTEXT, lora)
            rows.append({"engine": "cb_sync", "model": "qwen3-4b-shape", "lora": lora, "batch": batch,
                         "context": CONTEXT, "compile": args.compile, **times, "floor_ms": round(floor_ms, 2),
                         "graph_pct_of_floor": round(100 * floor_ms / times["graph_ms"], 1)})
            print(rows[-1], flush=True)
    table = markdown_table(
        ["LoRA", "batch", "eager ms", "graph ms" + (" (compiled)" if args.compile else ""), "floor ms", "of floor"],
        [["yes" if r["lora"] else "no", r["batch"], r["eager_ms"], r["graph_ms"], r["floor_ms"],
          f"{r['graph_pct_of_floor']}%"] for r in rows])
    write_results(args.name, rows, table)
    print(table)


if __name__ == "__main__":
    main()
