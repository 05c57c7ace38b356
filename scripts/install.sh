#!/usr/bin/env bash
# Create .venv (if missing) and install genolong with its test dependencies, CPU-only.
# torch 2.13.0 comes first and pinned: on the project machines pip takes its CPU build from
# local disk; a looser request would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

# A line per step with the seconds since the start, and pip's one line per package it fetches:
# the whole install takes a minute or two, and must not look hung.
STARTED=$(date +%s)
step() { echo "install [$(($(date +%s) - STARTED)) s]: $*"; }
packages() { { grep --line-buffered -E '^(Collecting|Successfully installed)' || true; } | sed -u 's/^/    /'; }

[ -x .venv/bin/python ] || { step "creating .venv"; python3 -m venv .venv; }
py=.venv/bin/python
step "pip"
$py -m pip install -q --upgrade pip
step "torch 2.13.0 (CPU)"
$py -m pip install --progress-bar off "torch==2.13.0" | packages
step "genolong and its test dependencies (-e .[test])"
$py -m pip install --progress-bar off -e ".[test]" | packages

# The TileLang sparse-attention kernels genolong pads into live in megatron-core, which ships
# only cp312 wheels (it needs Python >= 3.12 to *run*). The kernel definitions are plain Python,
# so for the CPU compile-only test (tests/kernels/test_compile.py) on Python 3.11 we unpack the
# package's sources beside the venv and put them on its path. On Python >= 3.12 use the `gpu` extra.
if ! $py -c "import megatron.core" 2>/dev/null; then
  step "megatron-core's kernel sources (for the CPU compile-only test)"
  tmp=$(mktemp -d)
  $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$tmp" "megatron-core==0.19.2"
  rm -rf .venv/megatron-src && mkdir -p .venv/megatron-src
  $py -m zipfile -e "$tmp"/megatron_core-*.whl .venv/megatron-src
  rm -rf "$tmp"
  site=$($py -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$PWD/.venv/megatron-src" > "$site/genolong-megatron-src.pth"
fi
step "done: genolong is at .venv/bin/genolong (or run \`source .venv/bin/activate\` to put it on this shell's PATH)"
