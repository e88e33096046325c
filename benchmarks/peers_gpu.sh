#!/usr/bin/env bash
# The benchmarks' peers on one H200 (vLLM 0.26.0, TRL 1.16 + vLLM colocate, Unsloth 2026.10.9), from the wheels of
# benchmarks/peers_wheels.sh (.whl, .unsloth-wheels) and ../shared/peers/vllm_wheels.sh (.vllm-wheels/p1..p6).
# One machine, calls back to back (its /tmp lives only while it stays warm). Results and one log go to $OUT.
#   bash benchmarks/peers_gpu.sh STAGE [STAGE ...]
#   copy1 .. copy5  carry .vllm-wheels/pN: part N of the vLLM wheel into /tmp/vl/
#   copyq1 .. copyq4, copyqr   the same parts cut once more (a 60 MiB part and the project tree exceed a call's
#                   carry): `split -b 58M -a 1 pN/PART qN/PART.` for N = 1..4, then every `.b` piece moved to qr/;
#                   carry qN (then qr): the pieces are joined into their parts when vLLM is installed
#   tp_cb           Workload T, cb_sync_compiled in a process of its own         -> throughput_peers_cb.*
#   tp_vllm         Workload T, vllm and vllm_nolora, one process each           -> throughput_peers_vllm.*
#   tp_all          Workload T, cb_sync_compiled, vllm, vllm_nolora             -> throughput_peers.*
#                   (vllm stages: carry .vllm-wheels/p6 and .whl; /tmp/vsite is made once from /tmp/vl's parts)
#   grpo_cb         Workload G, cb_sync (compiled)                               -> grpo_peers_cb.*
#                   (carry .whl and a dill wheel: .unsloth-wheels/dill-0.4.1-py3-none-any.whl or .vllm-wheels/p6)
#   grpo_unsloth    Workload G, unsloth in a process of its own (carry .unsloth-wheels; this process takes
#                   datasets from /tmp/vsite, else from /tmp/usite)             -> grpo_peers_unsloth.*
#   grpo_vllm       Workload G, trl_vllm and trl_vllm_sleep, one process each   -> grpo_peers_vllm.*
#   grpo_all        Workload G, cb_sync (compiled), trl_vllm, trl_vllm_sleep     -> grpo_peers.*
#   long_cb         Workload L, cb_sync_compiled                                  -> long_rollouts_cb.*
#   long_vllm       Workload L, vllm and vllm_nolora, one process each            -> long_rollouts_vllm.*
#   long_vllm_nolora   Workload L, vllm_nolora alone                               -> long_rollouts_vllm_nolora.*
#   long_hf         Workload L, hf_generate and hf_generate_static                -> long_rollouts_hf.*
#   long_flash_prefill   Workload L, cb_sync_compiled with attn_backend auto, then flash_prefill, one process
#                   each, half the call's time each (flash-attn 4 installed in /tmp/fsite by the two calls of
#                   benchmarks/flash_wheels.sh)                                  -> long_rollouts_flash_prefill.*
#   long_attention  decode attention at reasoning lengths, every variant         -> long_attention.*
#   draw            the sampler's draw over the vocabulary, a program a row against split rows -> draw_kernel.*
#                   (LONG_ARGS is appended to the long_* stages' arguments: e.g. LONG_ARGS="--sampler grpo")
# Merge the calls' results afterwards (CPU):
#   python -m benchmarks.throughput --from-json DIR1/throughput_peers_cb.json DIR2/throughput_peers_vllm.json \
#       --name throughput_peers
#   python -m benchmarks.grpo --from-json DIR3/grpo_peers_cb.json DIR4/grpo_peers_vllm.json \
#       DIR5/grpo_peers_unsloth.json --name grpo_peers
#   python -m benchmarks.long_rollouts --from-json DIR6/long_rollouts_cb.json DIR7/long_rollouts_vllm.json \
#       --name long_rollouts
# Stages of one call share its budget: a stage's time limit is a cap, and one that ends early leaves the rest.
# CALL_BUDGET (seconds, default 570) bounds the whole call: each stage's time limit is what is left of it.
# The call exits non-zero where a stage failed: a copy, an install, a benchmark that left a row unmeasured.
# TP_ARGS / GRPO_ARGS are appended to the benchmarks' arguments (last, so they win: e.g. GRPO_ARGS="--workload G2
# --model qwen3-1.7b --steps 5"; benchmarks.grpo hands --workload and --model on to the peers' own processes).
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn UNSLOTH_DISABLE_STATISTICS=1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET=${CALL_BUDGET:-570}
W=vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
W_SHA256=adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de
GRPO_SHAPE="--steps 8 --warmup 2"

left() { echo $((BUDGET - ($(date +%s) - T0))); }
say() { echo "[peers_gpu +$(($(date +%s) - T0))s] $*"; }
pip_target() {  # TARGET WHEEL...
  local target=$1; shift
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$@"
}

site_vllm() {  # /tmp/vsite: vLLM + its packages (the parts in /tmp/vl, .vllm-wheels/p6); TRL 1.16 + datasets (.whl)
  if [ ! -f /tmp/vsite/vllm/__init__.py ]; then
    local piece
    for piece in /tmp/vl/$W.part-a?.a; do   # a part carried in two pieces (copyqN + copyqr)
      [ -f "$piece" ] && [ -f "${piece%.a}.b" ] || continue
      cat "$piece" "${piece%.a}.b" > "${piece%.a}" && rm "$piece" "${piece%.a}.b"
    done
    local parts; parts=$(ls /tmp/vl/$W.part-a? 2>/dev/null | wc -l)
    if [ "$parts" = 5 ] && [ -d .vllm-wheels/p6 ]; then
      cat /tmp/vl/$W.part-a? > /tmp/$W
      if echo "$W_SHA256  /tmp/$W" | sha256sum -c --quiet; then
        pip_target /tmp/vsite /tmp/$W .vllm-wheels/p6/*.whl && say "installed vLLM into /tmp/vsite"
      else
        say "the vLLM wheel put together from /tmp/vl does not match its sha256: vLLM left out"
      fi
      rm -f /tmp/$W
    else
      say "vLLM left out: $parts of 5 parts in /tmp/vl, .vllm-wheels/p6 $([ -d .vllm-wheels/p6 ] || echo not) carried"
    fi
  fi
  if [ ! -f /tmp/vsite/trl/__init__.py ] && [ -d .whl ]; then
    local dill=""                            # one dill only: p6's where vLLM brought it
    [ -d /tmp/vsite/dill ] || dill=$(ls .whl/dill-*.whl .vllm-wheels/p6/dill-*.whl .unsloth-wheels/dill-*.whl \
      2>/dev/null | head -1)
    pip_target /tmp/vsite $(ls .whl/*.whl | grep -v dill-) $dill && say "installed TRL + datasets into /tmp/vsite"
  fi
  export PYTHONPATH=/tmp/vsite${PYTHONPATH:+:$PYTHONPATH}
  python3 -m pip list 2>/dev/null | grep -iE "^(vllm|trl|datasets|torch|transformers|peft|accelerate) " || true
}

site_unsloth() {  # /tmp/usite: Unsloth's own target directory
  if [ ! -f /tmp/usite/unsloth/__init__.py ] && [ -d .unsloth-wheels ]; then
    pip_target /tmp/usite .unsloth-wheels/*.whl && say "installed Unsloth's set into /tmp/usite"
  fi
}

throughput() {  # NAME ENGINE...
  local name=$1; shift
  local limit; limit=$(left)
  say "throughput $* (limit $limit s)"
  timeout -s INT -k 30 "$limit" python3 -m benchmarks.throughput --isolate --engines "$@" --batches 4 32 128 \
    --no-lora-engines --name "$name" --out "$OUT" --time-limit $((limit - 30)) $TP_ARGS
}

grpo() {  # NAME BACKEND... (flags first)
  local name=$1; shift
  local limit; limit=$(left)
  say "grpo $* (limit $limit s)"
  timeout -s INT -k 60 "$limit" python3 -m benchmarks.grpo "$@" $GRPO_SHAPE --time-limit $((limit - 60)) \
    --unsloth-site /tmp/usite --name "$name" --out "$OUT" $GRPO_ARGS
}

long_rollouts() {  # NAME ENGINE...  (STAGE_LIMIT: seconds for this run, else what is left)
  local name=$1; shift
  local limit; limit=${STAGE_LIMIT:-$(left)}
  [ "$limit" -gt 30 ] || { say "long_rollouts $name: no time left"; return 1; }
  say "long_rollouts $* (limit $limit s)"
  timeout -s INT -k 30 "$limit" python3 -m benchmarks.long_rollouts --engines "$@" --name "$name" --out "$OUT" \
    --time-limit $((limit - 30)) $LONG_ARGS
}

site_flash() {  # flash-attn 4 from /tmp/fsite (benchmarks/flash_wheels.sh's --target install skips its .pth)
  local site=/tmp/fsite:/tmp/fsite/nvidia_cutlass_dsl/dsl_packages
  [ -d /tmp/fsite ] && export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  return 0
}

need_flash() {
  python3 -c "import flash_attn.cute" 2>/dev/null || { say "flash-attn 4 does not import: stage skipped"; return 1; }
}

merge_long() {  # NAME PART...: the Workload L rows of the parts that wrote any, merged into NAME
  local name=$1 part files=(); shift
  for part in "$@"; do [ -f "$OUT/$part.json" ] && files+=("$OUT/$part.json"); done
  [ ${#files[@]} -gt 0 ] || { say "$name: no rows to merge"; return 1; }
  python3 -m benchmarks.long_rollouts --from-json "${files[@]}" --name "$name" --out "$OUT"
}

need_vllm() {  # a vLLM stage without vLLM installed fails here, not after its engine start
  [ -f /tmp/vsite/vllm/__init__.py ] || { say "vLLM is not installed in /tmp/vsite: stage skipped"; return 1; }
}

run_stages() {
  local status=0
  for stage in "$@"; do
    case "$stage" in
      copy[1-5]|copyq[1-4]|copyqr)
        folder=${stage#copy}; [ -d ".vllm-wheels/$folder" ] || folder=p$folder    # copy1 -> p1, copyq1 -> q1
        mkdir -p /tmp/vl && cp ".vllm-wheels/$folder"/* /tmp/vl/ && say "/tmp/vl: $(ls /tmp/vl | wc -l) files" ;;
      long_cb)
        long_rollouts long_rollouts_cb cb_sync_compiled ;;
      long_vllm)
        site_vllm && need_vllm && long_rollouts long_rollouts_vllm vllm vllm_nolora ;;
      long_vllm_nolora)
        site_vllm && need_vllm && long_rollouts long_rollouts_vllm_nolora vllm_nolora ;;
      long_hf)
        long_rollouts long_rollouts_hf hf_generate hf_generate_static ;;
      long_flash_prefill)
        site_flash && need_flash && {
          STAGE_LIMIT=$(($(left) / 2)) LONG_ARGS="$LONG_ARGS --attn-backend auto" \
            long_rollouts long_rollouts_backend_auto cb_sync_compiled
          LONG_ARGS="$LONG_ARGS --attn-backend flash_prefill" long_rollouts long_rollouts_backend_flash cb_sync_compiled
          merge_long long_rollouts_flash_prefill long_rollouts_backend_auto long_rollouts_backend_flash; } ;;
      draw)
        say "draw_kernel (limit $(left) s)"
        timeout -s INT -k 30 "$(left)" python3 -m benchmarks.draw_kernel --out "$OUT" ;;
      long_attention)
        say "long_attention (limit $(left) s)"
        timeout -s INT -k 30 "$(left)" python3 -m benchmarks.long_attention --out "$OUT" $LONG_ARGS ;;
      tp_cb)
        throughput throughput_peers_cb cb_sync_compiled ;;
      tp_vllm)
        site_vllm && need_vllm && throughput throughput_peers_vllm vllm vllm_nolora ;;
      tp_all)
        site_vllm && need_vllm && throughput throughput_peers cb_sync_compiled vllm vllm_nolora ;;
      grpo_cb)
        site_vllm
        grpo grpo_peers_cb --cb-compile --backends cb_sync ;;
      grpo_unsloth)
        site_unsloth
        if [ -f /tmp/vsite/datasets/__init__.py ]; then export PYTHONPATH=/tmp/vsite${PYTHONPATH:+:$PYTHONPATH}
        else export PYTHONPATH=/tmp/usite${PYTHONPATH:+:$PYTHONPATH}; fi   # this process needs datasets, not TRL
        grpo grpo_peers_unsloth --backends unsloth ;;
      grpo_vllm)
        site_vllm
        grpo grpo_peers_vllm --backends trl_vllm trl_vllm_sleep ;;
      grpo_all)
        site_vllm
        grpo grpo_peers --cb-compile --backends cb_sync trl_vllm trl_vllm_sleep ;;
      *) echo "unknown stage $stage" >&2; return 2 ;;
    esac || { status=1; say "stage $stage failed"; }
  done
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv
  say "done (exit status $status)"
  return $status
}

run_stages "$@" 2>&1 | tee -a "$OUT/peers_gpu.log"
