#!/usr/bin/env bash
# Fetch flash-attn-4 (FlashAttention's CuTe-DSL kernels, JIT-compiled, with Hopper forward kernels) and the packages
# the GPU machine lacks for it, as Python 3.12 x86-64 wheels, into two folders that each fit a device call:
#   bash benchmarks/flash_wheels.sh          # -> .flash-wheels/f1, .flash-wheels/f2 (git-ignored)
# The CUDA 13 flavour of nvidia-cutlass-dsl's libraries (the machine's driver runs CUDA 13.0) is a 92 MB wheel: it
# travels in two parts, one a call, put together on the machine. On one warm machine:
#   call 1: carry .flash-wheels/f1, command: mkdir -p /tmp/fl && cp .flash-wheels/f1/* /tmp/fl/
#   call 2: carry .flash-wheels/f2, command starts with:
#     R=$PWD; cd /tmp/fl && cp $R/.flash-wheels/f2/* . &&
#     W=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl && cat $W.part-a $W.part-b > $W && sha256sum -c libs_cu13.sha256 &&
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fsite *.whl; cd $R
#     export PYTHONPATH=/tmp/fsite:/tmp/fsite/nvidia_cutlass_dsl/dsl_packages   # the .pth a --target install skips
# Seen on the H200 (torch 2.11 + CUDA 13.0, driver 580): `import flash_attn.cute` works, paged decode and varlen
# prefill run; its split-KV path refuses sm90, so cb_sync's flash backend decodes with num_splits=1.
# nvidia-cutlass-dsl itself is installed without its dependencies: it names the CUDA 12 flavour unconditionally.
set -euo pipefail
DIR=.flash-wheels
rm -rf "$DIR" && mkdir -p "$DIR/all" "$DIR/f1" "$DIR/f2"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DIR/all" flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 \
  nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
  quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 cuda-bindings==13.5.0 \
  cuda-pathfinder==1.9.1 einops==0.8.2 protobuf==7.36.2
LIBS=$(ls "$DIR"/all/nvidia_cutlass_dsl_libs_cu13-*.whl)
sha256sum "$LIBS" | sed "s|$DIR/all/||" > "$DIR/f2/libs_cu13.sha256"
split -b 46M -a 1 "$LIBS" "$DIR/f1/$(basename "$LIBS").part-"
mv "$DIR/f1/$(basename "$LIBS").part-b" "$DIR/f2/"
rm "$LIBS"
mv "$DIR"/all/cuda_bindings-*.whl "$DIR/f1/"
mv "$DIR"/all/*.whl "$DIR/f2/"
rmdir "$DIR/all"
du -sh "$DIR"/f1 "$DIR"/f2
