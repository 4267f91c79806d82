#!/usr/bin/env bash
# Set up the environment and run the stage-a CPU test suite (tests/fast).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
exec "$VENV/bin/python" -m pytest tests/fast -q "$@"
