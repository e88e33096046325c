"""First-use cost of scaled_dot_product_attention per sequence length, as the GRPO trainer's forward meets it
(Workload G: batch 4, 32 heads of 128, bf16, causal, sequence = prompt + 512): the first no-grad forward and the first
forward + backward at each new length, against the second, with cuDNN attention on (PyTorch's default on Hopper) and
off. A first call that costs seconds is a kernel built at run time for that shape.

    python -m benchmarks.sdpa_first_use [--lengths 512 642 641 639 640 643 642]   (512: the warm-up)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import cuda_seconds


def calls(length: int, heads: int = 32, head_dim: int = 128, batch: int = 4) -> dict[str, float]:
    """Seconds of a no-grad forward and of a forward + backward at one length, each run twice."""
    q, k, v = (torch.randn(batch, heads, length, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def no_grad():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def with_grad():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return {"no_grad_first": cuda_seconds(no_grad), "no_grad_again": cuda_seconds(no_grad),
            "grad_first": cuda_seconds(with_grad), "grad_again": cuda_seconds(with_grad)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 642, 641, 639, 640, 643, 642])
    args = parser.parse_args(argv)
    print("| cuDNN attention | length | no-grad first ms | no-grad again ms | fwd+bwd first ms | fwd+bwd again ms |")
    print("|---|---|---|---|---|---|")
    for cudnn in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for length in args.lengths:
            ms = {key: round(1e3 * s, 2) for key, s in calls(length).items()}
            print(f"| {'on' if cudnn else 'off'} | {length} | {ms['no_grad_first']} | {ms['no_grad_again']} | "
                  f"{ms['grad_first']} | {ms['grad_again']} |", flush=True)


if __name__ == "__main__":
    main()
