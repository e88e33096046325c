#!/usr/bin/env bash
# Reproduces the committed GPU results on one H200. Logs and result files go to $OUT (or benchmarks/results).
#   bash benchmarks/run_h200.sh tests                         GPU tests (kernels, graphs, invalidation, 4B logprobs)
#   bash benchmarks/run_h200.sh throughput [ARGS]             Workload T vs HF generate and transformers CB
#   bash benchmarks/run_h200.sh decode [ARGS]                 decode-step probe per bucket, eager vs graph
#   bash benchmarks/run_h200.sh loop [ARGS]                   driver-loop probe: wall ms per step vs replay
#   bash benchmarks/run_h200.sh invariant [ARGS]              batch-invariant mode: cost and mismatch tables
#   bash benchmarks/run_h200.sh grpo [ARGS]                   Workload G; needs .whl/ (benchmarks/peers_wheels.sh)
#     and a dill wheel (carry .vllm-wheels/p6 or .unsloth-wheels too); the image's own pyarrow is used
#   bash benchmarks/run_h200.sh grpo_hook [ARGS]              trainer rollouts against the driver alone; as grpo
#   bash benchmarks/run_h200.sh grpo_training [ARGS]          the training half alone, variants; as grpo
#   bash benchmarks/run_h200.sh grpo_ddp [ARGS]               Workload G on 1 GPU, then 2 (nvidia-h200-x2); as grpo
#   The peers (vLLM, TRL + vLLM, Unsloth): benchmarks/peers_gpu.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
stage=${1:-tests}; shift || true
name=""; previous=""
for arg in "$@"; do [ "$previous" = --name ] && name=$arg; previous=$arg; done
case "$stage" in
  tests)
    timeout 400 python -m pytest tests/test_gpu.py tests/test_triton_kernels.py tests/test_lora_kernels.py \
      tests/test_invariant_kernels.py tests/test_attention_warmup.py tests/test_flash_attention.py \
      -m gpu -q -s 2>&1 | tee "$OUT/gpu_tests.log" ;;
  throughput)
    name=${name:-throughput}     # only this run's files come back (a transfer holds a handful of files)
    timeout 590 python -m benchmarks.throughput "$@" 2>&1 | tee "$OUT/$name.log"
    cp benchmarks/results/"$name".{json,md,png} "$OUT/" 2>/dev/null ;;
  decode)
    name=${name:-decode_graphs}
    timeout 550 python -m benchmarks.decode_graphs "$@" 2>&1 | tee "$OUT/$name.log"
    cp benchmarks/results/"$name".{json,md} "$OUT/" 2>/dev/null ;;
  invariant)
    name=${name:-batch_invariant}
    timeout 550 python -m benchmarks.batch_invariant "$@" 2>&1 | tee "$OUT/$name.log"
    cp benchmarks/results/"$name".{json,md} "$OUT/" 2>/dev/null ;;
  loop)
    timeout 550 python -m benchmarks.decode_loop --out "$OUT" "$@" 2>&1 | tee "$OUT/decode_loop.log" ;;
  grpo|grpo_hook|grpo_training)
    rm -rf /tmp/site
    dill=$(ls .whl/dill-*.whl .vllm-wheels/p6/dill-*.whl .unsloth-wheels/dill-*.whl 2>/dev/null | head -1)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      $(ls .whl/*.whl | grep -v -e pyarrow -e dill) $dill || exit
    export PYTHONPATH=/tmp/site:$PYTHONPATH
    timeout -s INT -k 15 550 python -m benchmarks."$stage" --out "$OUT" "$@" 2>&1 | tee "$OUT/$stage.log" ;;
  grpo_ddp)   # Workload G on 1 GPU, then on 2 (accelerate launch; nvidia-h200-x2); the wheels of grpo
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $(ls .whl/*.whl | grep -v pyarrow) || exit
    PYTHONPATH=/tmp/site:$PYTHONPATH timeout -s INT -k 15 580 python -m benchmarks.grpo_ddp --out "$OUT" "$@" 2>&1 | tee "$OUT/grpo_ddp.log" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
