#!/usr/bin/env bash
# Fetch the peers' packages as Python 3.12 x86-64 wheels, on a machine with the package index, for a GPU machine
# without one (benchmarks/gpu.sh installs them there). From the project root:
#   bash benchmarks/wheels.sh [trl] [vllm] [unsloth] [flash]        # default: all four sets
#   PART_MIB=60 bash benchmarks/wheels.sh vllm     # also cut each set into folders DIR/p1, p2, ... of at most 60 MiB
#                                                  # (larger wheels in pieces), for transfers of limited size
# Sets and their folders (git-ignored):
#   trl      .whl             TRL 1.16 + datasets: the GRPO benchmark's own process and TRL + vLLM colocate
#   vllm     .vllm-wheels     vLLM 0.26.0, the newest release built for torch 2.11 + CUDA 13.0, and the packages a
#                             plain Qwen3 path imports that the GPU machine lacks (cutlass-dsl, quack, tilelang,
#                             torchcodec, the server extras and numba are left out: numba 0.65 breaks numpy 2.5)
#   unsloth  .unsloth-wheels  Unsloth 2026.10.9 with its own TRL 1.15 and datasets < 5 (its own target directory) and
#                             bitsandbytes 0.50.2: Unsloth's loader imports it on every load, whatever the dtype
#   flash    .flash-wheels    flash-attn 4 (FlashAttention's CuTe-DSL kernels) and nvidia-cutlass-dsl's CUDA 13
#                             libraries (cb_sync's attn_backend="flash"); nvidia-cutlass-dsl is installed without
#                             its dependencies: it names the CUDA 12 flavour unconditionally
# Each folder gets SHA256SUMS, which gpu.sh checks after putting pieces back together.
set -euo pipefail
declare -A DIRS=([trl]=.whl [vllm]=.vllm-wheels [unsloth]=.unsloth-wheels [flash]=.flash-wheels)
declare -A PKGS=(
  [trl]="trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19 dill==0.4.1"
  [vllm]="vllm==0.26.0 annotated_types==0.8.0 apache_tvm_ffi==0.1.10 astor==0.8.1 cachetools==8.0.2 cbor2==6.3.0
    depyf==0.20.0 dill==0.4.1 dnspython==2.9.2 email_validator==2.4.0 fastapi==0.136.3 flashinfer_python==0.6.14
    httpcore2==2.16.2 httpx2==2.16.2 jiter==0.19.0 jsonschema==4.26.0 jsonschema_specifications==2025.9.1
    llguidance==1.7.6 mistral_common==1.13.1 msgspec==0.23.0 openai==3.57.0 openai_harmony==0.0.8
    partial_json_parser==0.2.1.1.post7 pybase64==1.5.1 pycountry==26.2.16 pydantic==2.14.4 pydantic_core==2.50.5
    pydantic_extra_types==2.11.1 python_multipart==0.0.34 pyzmq==27.3.0 referencing==0.37.0 rpds_py==2026.9.1
    setproctitle==1.3.8 sniffio==1.3.1 starlette==1.10.0 truststore==0.10.5 typing_extensions==4.16.0
    typing_inspection==0.4.5 uvloop==0.23.0 xgrammar==0.2.7"
  [unsloth]="bitsandbytes==0.50.2 unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5
    multiprocess==0.70.19 dill==0.4.1 xxhash==4.1.0 fsspec==2026.2.0"
  [flash]="flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
    nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5
    apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 cuda-bindings==13.5.0 cuda-pathfinder==1.9.1
    einops==0.8.2 protobuf==7.36.2"
)
PLATFORMS=""
for p in manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 \
  manylinux_2_5 manylinux1; do PLATFORMS="$PLATFORMS --platform ${p}_x86_64"; done

split_into_parts() {  # DIR: its wheels into DIR/p1, p2, ... of at most PART_MIB each, wheels too large in pieces
  local dir=$1 limit=$((PART_MIB * 1024 * 1024)) part=0 size file piece
  local used=$limit          # the first wheel starts a part
  for file in "$dir"/*.whl; do
    size=$(stat -c %s "$file")
    if [ "$size" -gt "$limit" ]; then      # a part a piece; the next wheel starts a part of its own
      split -b "$limit" -a 2 "$file" "$file.part-" && rm "$file"
      for piece in "$file".part-*; do part=$((part + 1)); mkdir -p "$dir/p$part"; mv "$piece" "$dir/p$part/"; done
      used=$limit
      continue
    fi
    if [ $((used + size)) -gt "$limit" ]; then part=$((part + 1)); used=0; mkdir -p "$dir/p$part"; fi
    mv "$file" "$dir/p$part/"
    used=$((used + size))
  done
  mv "$dir/SHA256SUMS" "$dir/p$part/"
}

for set in "${@:-trl vllm unsloth flash}"; do
  for name in $set; do
    dir=${DIRS[$name]:?unknown set $name (trl, vllm, unsloth, flash)}
    rm -rf "$dir" && mkdir -p "$dir"
    for pkg in ${PKGS[$name]}; do
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
        -d "$dir" "$pkg"
    done
    (cd "$dir" && sha256sum ./*.whl > SHA256SUMS)
    [ -z "${PART_MIB:-}" ] || split_into_parts "$dir"
    du -sh "$dir"
  done
done
