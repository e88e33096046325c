"""The sampler's draw over the whole vocabulary (`gumbel_kernel.gumbel_argmax`, what an unfiltered sampler such as
GRPO's default runs every decode step): each row drawn by one program, against rows split across programs of
`SPLIT_COLUMNS` columns and combined, on fresh random fp32 logits of Qwen3's vocabulary (151,936). Microseconds per
draw from one CUDA graph of `--launches` draws, replayed; the floor is the logits read once at the card's copy
bandwidth. Each variant's tokens are checked equal to the other's and to torch's draw first.

    python -m benchmarks.draw_kernel [--rows 4 32 64 128] [--vocab 151936]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import RESULTS, copy_bandwidth, exit_code, graph_us, markdown_table, write_results
from cb_sync.sampling import draw_kernel as gumbel_kernel

VARIANTS = {"one_program_a_row": None, "split": gumbel_kernel.SPLIT_COLUMNS}   # None: the row's whole width


def draw(scores: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, variant: str) -> torch.Tensor:
    """gumbel_argmax with the variant's columns a program."""
    return gumbel_kernel.gumbel_argmax(scores, seeds, positions, None, VARIANTS[variant] or scores.shape[1])


def draw_inputs(rows: int, vocab: int, device: str = "cuda", seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.randn(rows, vocab, device=device, generator=gen) * 3
    seeds = torch.randint(-2 ** 62, 2 ** 62, (rows,), device=device, generator=gen)
    positions = torch.randint(0, 1 << 16, (rows,), device=device, generator=gen)
    return scores, seeds, positions


def draws_agree(rows: int, vocab: int, device: str = "cuda") -> bool:
    """Every variant's tokens equal torch's draw (sampling's uniform noise and argmax) on fresh random logits."""
    from cb_sync.sampling.sampler import uniform_noise
    scores, seeds, positions = draw_inputs(rows, vocab, device, seed=int(torch.randint(0, 2 ** 31, ())))
    noise = uniform_noise(seeds, positions, torch.arange(vocab, device=device)[None])
    expected = (scores - torch.log(-torch.log(noise))).argmax(dim=-1)
    return all(torch.equal(draw(scores, seeds, positions, variant), expected) for variant in VARIANTS)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 32, 64, 128])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--name", default="draw_kernel")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.draw_kernel times CUDA launches: it needs a GPU")
    rows = []
    for count in args.rows:
        if not draws_agree(count, args.vocab):
            rows.append({"rows": count, "error": "a variant's tokens differ from torch's draw"})
            continue
        scores, seeds, positions = draw_inputs(count, args.vocab)
        floor_us = 1e6 * scores.numel() * scores.element_size() / copy_bandwidth()
        for variant in VARIANTS:
            us = min(graph_us(lambda: draw(scores, seeds, positions, variant), args.launches, 20) for _ in range(2))
            rows.append({"rows": count, "vocab": args.vocab, "variant": variant, "us": round(us, 1),
                         "floor_us": round(floor_us, 1), "of_floor": round(floor_us / us, 3)})
            print(rows[-1], flush=True)
    table = markdown_table(["rows", "variant", "us a draw", "floor us", "of floor"],
                           [[r["rows"], r.get("variant", "-"), r.get("us", r.get("error")), r.get("floor_us", "-"),
                             r.get("of_floor", "-")] for r in rows])
    write_results(args.name, rows, table, args.out)
    print(table)
    return rows


if __name__ == "__main__":
    raise SystemExit(exit_code(main()))
