#!/usr/bin/env bash
# Shrink .device/site.tar.xz (made by ../shared/device/make-bundle.sh, ~50 MB) so that it and the
# tracked tree (~20 MB) fit the device's 64 MiB carry limit: drops what no GPU command imports —
# biopython (only genolong/data/synthetic.py's test helper writes BGZF with it) and z3's
# command-line executable (TileLang loads libz3.so). ~2 min on 2 cores; the result is ~42 MB.
set -euo pipefail
bundle=.device/site.tar.xz
[ -f "$bundle" ] || { echo "no $bundle: run bash ../shared/device/make-bundle.sh first" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -xJf "$bundle" -C "$work"
rm -rf "$work"/Bio "$work"/BioSQL "$work"/biopython-* "$work"/z3_solver-*.data/data/bin
tar -cf - -C "$work" . | xz -T0 -6 > "$work.tar.xz"
mv "$work.tar.xz" "$bundle"
ls -la "$bundle"
