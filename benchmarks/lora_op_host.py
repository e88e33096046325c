"""Host time of one LoRA op call, with the GPU left to run behind (the compiled prefill of a small batch is bound by
it): microseconds a call of the custom op, of `kernels.lora_linear_group` called directly (and of another revision's
with --other), of its two Triton launches (the call with the launches stubbed out, subtracted) and of nn.Linear alone,
for the four groups of a Qwen3-4B layer, in inference mode as inside generate().
    python -m benchmarks.lora_op_host [--rows 512 4096] [--other FILE] [--no-inference-mode]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from benchmarks.lora_layers import GROUPS, _load_module
from cb_sync.lora import kernels, ops  # noqa: F401  (registers the op)


def host_us(fn, calls: int = 100) -> float:
    """Host microseconds a call over `calls` calls queued without waiting (after ten unmeasured ones)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return round(seconds / calls * 1e6, 1)


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--other", default=None, help="another revision's cb_sync/lora/kernels.py")
    parser.add_argument("--no-inference-mode", action="store_true")
    args = parser.parse_args(argv)
    other = _load_module(args.other) if args.other else None
    torch.manual_seed(0)
    with contextlib.nullcontext() if args.no_inference_mode else torch.inference_mode():
        for rows in args.rows:
            for name, (k, widths) in GROUPS.items():
                w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n in widths]
                a = [torch.randn(32, k, device="cuda") * 0.02 for _ in widths]
                b = [torch.randn(n, 32, device="cuda") * 0.02 for n in widths]
                call = (torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), w, [], a, b, [2.0] * len(w),
                        torch.float32)
                times = {"op": host_us(lambda: torch.ops.cb_sync.lora_linear_group(*call)),
                         "direct": host_us(lambda: kernels.lora_linear_group(*call))}
                if other is not None:
                    same = all(torch.equal(x, y) for x, y in zip(other.lora_linear_group(*call),
                                                                  kernels.lora_linear_group(*call)))
                    times[f"other direct (same outputs: {same})"] = host_us(lambda: other.lora_linear_group(*call))
                launches = kernels._shrink_kernel, kernels._expand_kernel
                kernels._shrink_kernel = kernels._expand_kernel = _NoLaunch()
                try:
                    times["direct, launches stubbed"] = host_us(lambda: kernels.lora_linear_group(*call))
                finally:
                    kernels._shrink_kernel, kernels._expand_kernel = launches
                times["nn.Linear only"] = host_us(lambda: [torch.nn.functional.linear(call[0], x) for x in w])
                print(f"rows {rows:5d} {name:8s} " + "  ".join(f"{key} {us}" for key, us in times.items()), flush=True)


if __name__ == "__main__":
    main()
