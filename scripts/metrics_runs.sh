#!/usr/bin/env bash
# Four short, deterministic runs whose metrics.jsonl a pure restructuring must leave byte-identical
# (issue 32): the embedded default on Megatron and on FSDP, overlapped training with --use-tis, and
# the calculator custom-generate example. Run it on the old and the new tree and `cmp` each
# OUT/<name>/metrics.jsonl (timings go to metrics.timings.jsonl, so the metrics file does not
# depend on the machine's speed). ~5 minutes on 2 cores.
#
#   bash scripts/metrics_runs.sh OUT_DIR [REPO_DIR]     (REPO_DIR: the tree to run, default this one)
set -uo pipefail
OUT=$(realpath -m "$1")
REPO=$(realpath "${2:-$(dirname "$0")/..}")
PY=${PYTHON:-$REPO/.venv/bin/python}
mkdir -p "$OUT"
cd "$REPO"
export PYTHONPATH="$REPO" RL_PLUGIN_CACHE="$OUT/cache"
T="$PY -m rl_plugin.train"
run() {
    name=$1
    shift
    $T "$@" --output-dir "$OUT/$name" --no-progress-bar >"$OUT/$name.log" 2>&1
    echo "$name rc=$?"
}
run megatron --train-backend megatron --num-rollout 12 --eval-interval 6
run fsdp --train-backend fsdp --num-rollout 12 --eval-interval 6
run overlapped_tis --train-backend megatron --num-rollout 8 --max-weight-staleness 1 --use-tis --eval-interval 4
RL_PLUGIN_TRAIN="$T" OUT="$OUT/custom_generate" PYTHON=$PY bash examples/calculator_tool_cpu.sh --num-rollout 6 \
    --no-progress-bar >"$OUT/custom_generate.log" 2>&1
echo "custom_generate rc=$?"
