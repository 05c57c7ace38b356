#!/usr/bin/env bash
# Pack the Python packages that the GPU machine lacks into one archive small enough to travel with
# the working tree (everything sent must stay under 64 MiB):
#
#   bash benchmarks/device/make-bundle.sh     # from the project root; writes .device/ (~3-5 min)
#
# Then send .device/ with the working tree and begin each GPU command with
#   source .device/activate.sh
# (.device/ holds a copy of activate.sh beside the archive; both are git-ignored.)
#
# The device image has Python 3.12, torch 2.11 (CUDA 13), triton 3.6, numpy, pandas, pyarrow,
# matplotlib, rich, typer, tqdm, einops, safetensors, transformers, pytest, and no package index.
# It lacks: flash-linear-attention, fla-core, tilelang (+ apache-tvm-ffi, torch-c-dlpack-ext, z3's
# library), megatron-core, pyfaidx, datasets (+ its small deps), ray. Left out on purpose, for size:
# ray (GPU runs use the local launcher), biopython (only a CPU test helper writes BGZF with it) and
# z3's command-line executable (tilelang loads libz3.so only). EXTRA_PKGS adds wheels.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
out="$root/.device"
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pkgs=(flash-linear-attention==0.6.0 fla-core==0.6.0 tilelang==0.1.15 "apache-tvm-ffi>=0.1.11,<0.1.13"
      torch-c-dlpack-ext==0.1.5 "z3-solver>=4.13,<4.15.5" megatron-core==0.19.2 pyfaidx
      datasets dill multiprocess xxhash ${EXTRA_PKGS:-})
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/whl" "${pkgs[@]}"
mkdir -p "$work/site"
for w in "$work"/whl/*.whl; do unzip -q -o "$w" -d "$work/site"; done
# z3: keep only its Python package and the one shared library tilelang links against.
find "$work/site/z3/lib" -type f ! -name 'libz3.so*' -delete 2>/dev/null || true
rm -f "$work/site/z3/lib/libz3.so" && (cd "$work/site/z3/lib" && ls libz3.so.* >/dev/null)
rm -rf "$work"/site/z3_solver-*.data/data/bin
tar -cf - -C "$work/site" . | xz -T0 -6 > "$out/site.tar.xz"
cp "$(dirname "$0")/activate.sh" "$out/activate.sh"
ls -la "$out"
