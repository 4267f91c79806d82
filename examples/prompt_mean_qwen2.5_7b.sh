#!/usr/bin/env bash
# Prompt-level mean (ScaleRL, Khatri et al. 2025): average the token losses within each prompt's
# group first, then over prompts, so every prompt weighs the same whatever its responses' lengths.
# A step must hold whole groups: --global-batch-size is a multiple of --n-samples-per-prompt.
# 8 GPUs FSDP training + 8 GPUs vLLM rollout (8 engines of 1 GPU), weights synced in place.
set -euo pipefail
MODEL_DIR=${MODEL_DIR:-/models/Qwen2.5-7B-Instruct}
DATA_DIR=${DATA_DIR:-/data}

MODEL_ARGS=(--train-backend fsdp --hf-checkpoint "$MODEL_DIR" --bf16)
CLUSTER_ARGS=(--actor-num-nodes 1 --actor-num-gpus-per-node 8 --rollout-num-gpus 8 --rollout-num-gpus-per-engine 1 --rollout-engine vllm)
ROLLOUT_ARGS=(
   --prompt-data "$DATA_DIR/math-12k.jsonl"
   --input-key problem
   --label-key answer
   --apply-chat-template
   --rm-type math_exact
   --rollout-batch-size 32
   --n-samples-per-prompt 16
   --rollout-max-response-len 8192
   --num-rollout 1000
)
LOSS_ARGS=(
   --advantage-estimator grpo
   --loss-aggregation prompt_mean
   --eps-clip 0.2
   --eps-clip-high 0.28
)
TRAIN_ARGS=(
   --global-batch-size 256
   --micro-batch-size 2
   --lr 1e-6
   --clip-grad 1.0
)
OUTPUT_ARGS=(--save /ckpt/prompt-mean-7b --load /ckpt/prompt-mean-7b --save-interval 50)

${RL_PLUGIN_TRAIN:-rl-plugin-train} "${MODEL_ARGS[@]}" "${CLUSTER_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${LOSS_ARGS[@]}" "${TRAIN_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
