"""The Triton decode kernel reaching the KV pools through their offset table (what captured decode steps do, so
they outlive a release of the cache) against the same launch given the pools' own pointers: microseconds per launch
(K/V store + attention, one CUDA graph of `--launches` launches, replayed), Qwen3-4B's attention shape (32 query
heads, 8 KV heads, head dim 128, bf16, blocks of 16), per batch and context.

    python -m benchmarks.attention_pools [--batches 4 32 128] [--contexts 640 2048 8192] [--launches 50]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import graph_us, markdown_table
from cb_sync.attention import triton_kernels
from cb_sync.engine.kv_cache import offsets_to_pools

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def launch_us(batch: int, context: int, through_table: bool, launches: int) -> float:
    """Microseconds per decode launch, replayed from a graph of `launches` launches."""
    blocks = batch * (context // BLOCK + 1)
    k_cache, v_cache = (torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
                        for _ in range(2))
    tables = torch.randperm(blocks, device="cuda", dtype=torch.int32)[:batch * (blocks // batch)].view(batch, -1)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    key, value = (torch.randn(batch, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    last = (seq_lens.long() - 1)
    slots = tables.long().gather(1, (last // BLOCK)[:, None])[:, 0] * BLOCK + last % BLOCK
    table = torch.zeros(1, 2, dtype=torch.int64, device="cuda")
    table.copy_(offsets_to_pools(table, [k_cache], [v_cache]))

    def step():
        triton_kernels.paged_attention(query, k_cache, v_cache, tables, seq_lens, starts, HEAD_DIM ** -0.5,
                                       new_kv=(key, value, slots), pool_offsets=table[0] if through_table else None)

    return graph_us(step, launches, 5)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 32, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[640, 2048, 8192])
    parser.add_argument("--launches", type=int, default=50)
    args = parser.parse_args(argv)
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            # pointers, table, pointers, table: an order effect would show as a difference between the rounds
            times = [launch_us(batch, context, through, args.launches) for through in (False, True, False, True)]
            rows.append({"batch": batch, "context": context, "pointers_us": round(min(times[0::2]), 2),
                         "table_us": round(min(times[1::2]), 2),
                         "table_over_pointers": round(min(times[1::2]) / min(times[0::2]), 3)})
            print(rows[-1], flush=True)
    print(markdown_table(list(rows[0]), [list(row.values()) for row in rows]))
    return rows


if __name__ == "__main__":
    main()
