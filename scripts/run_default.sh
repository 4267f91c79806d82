#!/usr/bin/env bash
# Set up the environment and run the main job.
# Until the training loop lands, this validates the sample training shell's flags.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
exec "$VENV/bin/python" -m rl_plugin.arguments $(grep -v '^#' examples/cpu_tiny.flags | tr '\n' ' ')
