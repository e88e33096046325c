#!/usr/bin/env bash
# Fetch, on a machine with the package index, the Python 3.12 x86-64 wheels the GPU machine lacks for the peers of
# the benchmarks (it has no internet; every device call carries at most 64 MiB with the repository). From the root:
#   bash benchmarks/peers_wheels.sh          # then: bash ../shared/peers/vllm_wheels.sh .vllm-wheels
# .whl              trl 1.16.0, datasets 5.2.0, multiprocess (dill comes with vLLM's set, xxhash is on the machine)
# .unsloth-wheels   Unsloth's own target directory: unsloth + unsloth_zoo 2026.10.9, trl 1.15.0, datasets 4.8.5,
#                   multiprocess, dill. Of Unsloth's listed requirements the benchmark's path (import unsloth, its
#                   patched GRPOTrainer, FastLanguageModel in bf16, fast_inference=False) imports none that the GPU
#                   machine lacks: bitsandbytes, xformers, torchao, cut_cross_entropy, vllm and torchvision imports
#                   are guarded (seen absent: each falls back), tyro, diffusers and hf_transfer are never imported,
#                   msgspec only by its vLLM path. The unsloth wheel is repacked without its web UI (studio/,
#                   unsloth_cli/: 80 MB, imported by nothing in unsloth) so that the set fits in one call.
# Add /.whl/, /.vllm-wheels/ and /.unsloth-wheels/ to .git/info/exclude.
set -euo pipefail
fetch() {  # DIR PKG...
  local dir=$1; shift
  mkdir -p "$dir"
  for p in "$@"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "$p"
  done
}
fetch .whl trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19
fetch .unsloth-wheels unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 multiprocess==0.70.19 \
  dill==0.4.1
python3 - <<'EOF'
"""Repack the unsloth wheel without studio/ and unsloth_cli/ (its RECORD and metadata rewritten to match)."""
import pathlib, zipfile
src = pathlib.Path(".unsloth-wheels/unsloth-2026.10.9-py3-none-any.whl")
dst = src.with_name("unsloth-2026.10.9-0nostudio-py3-none-any.whl")
drop = ("studio/", "unsloth_cli/", "unsloth-2026.10.9.dist-info/entry_points.txt")
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        if item.filename.startswith(drop):
            continue
        data = zin.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True)
                            if not line.startswith(tuple(d.encode() for d in drop)))
        elif item.filename.endswith(".dist-info/top_level.txt"):
            data = b"unsloth\n"
        zout.writestr(item, data)
src.unlink()
EOF
du -sh .whl .unsloth-wheels
