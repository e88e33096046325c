#!/usr/bin/env bash
# On the GPU machine: install the peers' wheels (benchmarks/wheels.sh) where they are, then run the GPU tests or a
# benchmark. From the project root:
#   bash benchmarks/gpu.sh tests                     the GPU tests (-m gpu, and the fused kernels' on CUDA), log in
#                                                    $OUT/gpu_tests.log
#   bash benchmarks/gpu.sh run WORKLOAD [ARGS]       python -m benchmarks WORKLOAD ARGS, the installed sets on the
#                                                    path, stopped with SIGINT (its rows kept) after $TIME_LIMIT s
#   bash benchmarks/gpu.sh collect DIR [DIR ...]     copy folders of wheels or pieces (wheels.sh's DIR/pN) into
#                                                    /tmp/wheels/<set>/: sets that reach the machine in parts
# e.g. bash benchmarks/gpu.sh run throughput --isolate --engines cb_sync_compiled vllm vllm_nolora --time-limit 540
#      bash benchmarks/gpu.sh run grpo --workload G2 --backends cb_sync_compiled trl_vllm
# A set is installed once a machine (trl, vllm, flash into /tmp/site; unsloth into /tmp/usite, its own target
# directory, which benchmarks.grpo's unsloth backend puts first on its path), from /tmp/wheels/<set>/ or the set's
# folder in the project; pieces are put back together and every wheel checked against SHA256SUMS first. Results go
# where the benchmark's --out says (benchmarks/results/<workload>/ by default); $OUT (default /tmp) gets the log.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn UNSLOTH_DISABLE_STATISTICS=1 \
  UNSLOTH_SITE=/tmp/usite
OUT=${OUT:-/tmp}
TIME_LIMIT=${TIME_LIMIT:-570}
declare -A DIRS=([trl]=.whl [vllm]=.vllm-wheels [unsloth]=.unsloth-wheels [flash]=.flash-wheels)
declare -A SITES=([trl]=/tmp/site [vllm]=/tmp/site [flash]=/tmp/site [unsloth]=/tmp/usite)
declare -A MARKERS=([trl]=trl [vllm]=vllm [flash]=flash_attn [unsloth]=unsloth)

say() { echo "[gpu.sh] $*"; }

install_set() {  # SET: from /tmp/wheels/SET or its project folder (whole, or in parts pN), once
  local set=$1 site=${SITES[$1]} source=/tmp/wheels/$1
  [ -d "$site/${MARKERS[$1]}" ] && return 0
  if [ ! -d "$source" ]; then
    [ -d "${DIRS[$set]}" ] || return 0
    mkdir -p "$source" && find "${DIRS[$set]}" -type f -exec cp {} "$source/" \;
  fi
  local wheel
  for wheel in $(ls "$source"/*.part-aa 2>/dev/null); do wheel=${wheel%.part-aa}; cat "$wheel".part-* > "$wheel"; done
  if ! (cd "$source" && sha256sum --quiet -c SHA256SUMS); then
    say "$set: its wheels do not match SHA256SUMS (a piece missing?): not installed"; return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$source"/*.whl && say "installed $set into $site"
}

case "${1:-}" in
  collect)
    shift
    for dir in "$@"; do
      set=$(basename "$(dirname "$dir/x")"); [[ $set == p[0-9]* ]] && set=$(basename "$(dirname "$dir")")
      for name in "${!DIRS[@]}"; do [ "${DIRS[$name]}" = "$set" ] && set=$name; done
      mkdir -p "/tmp/wheels/$set" && cp "$dir"/* "/tmp/wheels/$set/" && say "/tmp/wheels/$set: $(ls "/tmp/wheels/$set" | wc -l) files"
    done ;;
  tests)
    { timeout 500 python3 -m pytest tests -m gpu -q -s; timeout 80 python3 -m pytest tests/test_fused_kernels.py -q; } 2>&1 \
      | tee "$OUT/gpu_tests.log" ;;
  run)
    shift
    status=0
    for set in trl vllm flash unsloth; do install_set "$set" || status=1; done
    export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:.${PYTHONPATH:+:$PYTHONPATH}
    python3 -m pip list 2>/dev/null | grep -iE "^(vllm|trl|datasets|torch|transformers|peft|flash-attn-4) " || true
    timeout -s INT -k 60 "$TIME_LIMIT" python3 -m benchmarks "$@" 2>&1 | tee -a "$OUT/benchmarks.log" || status=1
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    exit $status ;;
  *)
    sed -n '2,14p' "$0"; exit 2 ;;
esac
