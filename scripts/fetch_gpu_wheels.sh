#!/usr/bin/env bash
# Download the wheels the GPU check carries to the loaned GPU machine (no network there; its
# Python 3.12 has torch, transformers, peft and triton, not megatron-core or mbridge):
# megatron-core 0.16.1 (cp312, manylinux x86-64) and mbridge 0.15.1, ~2.7 MB together, into
# tests/gpu/wheels/ (git-ignored: name it in the device tool's `carry`, tests/gpu/README.md).
# Versions: scripts/constraints.txt's pins.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/tests/gpu/wheels"
PY="${PYTHON:-python3}"
mkdir -p "$DEST"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$DEST" megatron-core==0.16.1 mbridge==0.15.1
ls -la "$DEST"
