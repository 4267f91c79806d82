#!/usr/bin/env bash
# Set up the environment and run the main job: the embedded default (a tiny model learns a
# synthetic digit-copy task with GRPO on the CPU; Megatron backend). Extra arguments are passed
# to rl-plugin-train, e.g. `bash scripts/run_default.sh --train-backend fsdp`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
exec "$VENV/bin/rl-plugin-train" --train-backend megatron "$@"
