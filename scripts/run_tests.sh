#!/usr/bin/env bash
# Set up the environment and run the stage-a CPU test suite (tests/fast). The machine and the
# versions are printed first, so a failure on another machine can be read from the log.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
"$VENV/bin/python" scripts/env_report.py
exec "$VENV/bin/python" -m pytest tests/fast -q "$@"
