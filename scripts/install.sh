#!/usr/bin/env bash
# Create .venv (if missing) and install genolong with its test dependencies, CPU-only.
# torch 2.13.0 comes first and pinned: on the project machines pip takes its CPU build from
# local disk; a looser request would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]"
