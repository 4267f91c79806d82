#!/usr/bin/env bash
# Create (or reuse) the virtual environment $VENV (default .venv) and install rl_plugin into it.
# On a machine without an NVIDIA GPU the CPU build of torch is installed FIRST: otherwise pip
# resolves torch (a dependency of megatron-core and of rl_plugin) to the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --disable-pip-version-check --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q torch==2.13.0
fi
python -m pip install -q -e ".[test]"
