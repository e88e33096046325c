#!/usr/bin/env bash
# Reproduces the committed GPU results on one H200: GPU tests, decode-step probe, throughput vs peers.
# Usage: bash benchmarks/run_h200.sh [tests] [throughput ARGS...]; logs go to $OUT (or benchmarks/results).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
stage=${1:-all}; shift || true
if [ "$stage" = tests ] || [ "$stage" = all ]; then
  timeout 400 python -m pytest tests/test_gpu.py tests/test_triton_kernels.py -m gpu -q -s 2>&1 | tee "$OUT/gpu_tests.log"
fi
if [ "$stage" = throughput ] || [ "$stage" = all ]; then
  timeout 500 python -m benchmarks.throughput "$@" 2>&1 | tee "$OUT/throughput.log"
  cp benchmarks/results/*.json benchmarks/results/*.md "$OUT/" 2>/dev/null
fi
