#!/usr/bin/env bash
# The one-GPU check (tests/gpu/README.md): installs the carried megatron-core / mbridge wheels
# (tests/gpu/wheels, if present) into a scratch folder, then runs every case of tests/gpu/check.py,
# each in its own process with its own timeout, within a 420 s budget (under 8 minutes in all).
#
#   scripts/gpu_check.sh OUT_DIR [--only a,b] [--budget-s S] [--dry-run --device cpu]
#
# Writes OUT_DIR/gpu_check.json (one entry per case) and OUT_DIR/gpu_check.log (every case's
# output). Exit status 0 when no case failed, errored or timed out (skipped ones do not count).
# Each case runs in a session of its own (so it can be killed whole at its timeout); when the
# outer timeout (RL_GPU_CHECK_TIMEOUT_S, default 470 s) or a signal ends the driver, the running
# case's process group is killed too (by the driver, and here on exit: the file the driver names
# it in), so no case is left holding the GPU.
set -uo pipefail
OUT="${1:?usage: scripts/gpu_check.sh OUT_DIR [tests.gpu.check options]}"
shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
echo "[gpu_check] $(date -u +%FT%TZ) on ${HOSTNAME:-?}; python: $("$PY" -c 'import sys; print(sys.version.split()[0])')" | tee -a "$OUT/gpu_check.log"
if compgen -G "tests/gpu/wheels/*.whl" >/dev/null; then
    SITE="${TMPDIR:-/tmp}/rl_gpu_check_site"
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" tests/gpu/wheels/*.whl >>"$OUT/gpu_check.log" 2>&1; then
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        echo "[gpu_check] installed: $(cd tests/gpu/wheels && ls -- *.whl | tr '\n' ' ')" | tee -a "$OUT/gpu_check.log"
    else
        echo "[gpu_check] the wheel install failed (see gpu_check.log): the Megatron cases will be skipped" | tee -a "$OUT/gpu_check.log"
    fi
else
    echo "[gpu_check] no tests/gpu/wheels/*.whl (scripts/fetch_gpu_wheels.sh, and carry it): the Megatron cases will be skipped" | tee -a "$OUT/gpu_check.log"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# the driver keeps to its budget; this outer limit only guards against the driver itself hanging
CASE_PGID="$(mktemp "${TMPDIR:-/tmp}/rl_gpu_check_case.XXXXXX")"
export RL_GPU_CHECK_CASE_PGID_FILE="$CASE_PGID"
kill_case() {  # the running case's whole process group, if the driver left one
    local g
    g="$(cat "$CASE_PGID" 2>/dev/null)"
    if [ -n "$g" ]; then kill -KILL -- "-$g" 2>/dev/null; fi
    rm -f "$CASE_PGID"
}
stop() {  # a signal to this script: the driver (through timeout, which passes it on) and the case
    [ -n "${DRIVER:-}" ] && kill -TERM "$DRIVER" 2>/dev/null && wait "$DRIVER"
    exit "$1"
}
trap kill_case EXIT
trap 'stop 143' TERM
trap 'stop 130' INT
trap 'stop 129' HUP
# in the background, and waited for: a trap runs at once during `wait` (not after the command)
timeout "${RL_GPU_CHECK_TIMEOUT_S:-470}" "$PY" -m tests.gpu.check --out "$OUT" "$@" &
DRIVER=$!
wait "$DRIVER"
