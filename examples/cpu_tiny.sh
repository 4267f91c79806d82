#!/usr/bin/env bash
# The embedded default on a CPU with two training processes (gloo, DP=2): a tiny Qwen2-architecture
# model learns to copy digits with GRPO. Without the flags below, `rl-plugin-train --train-backend
# megatron` runs the same task with one training process.
set -euo pipefail
BACKEND=${BACKEND:-megatron}

CLUSTER_ARGS=(
   --train-backend "$BACKEND"
   --actor-num-nodes 1
   --actor-num-gpus-per-node 2      # on a CPU machine: two CPU training processes
)
ROLLOUT_ARGS=(
   --rollout-batch-size 16
   --n-samples-per-prompt 8
   --rollout-max-response-len 4
   --rollout-temperature 1.0
   --num-rollout 300
   --eval-interval 25
)
TRAIN_ARGS=(
   --global-batch-size 128
   --micro-batch-size 64
   --lr 3e-3
   --advantage-estimator grpo
   --loss-aggregation sample_mean
   --eps-clip 0.2
   --eps-clip-high 0.28
   --pg-metrics with_entropy
)
OUTPUT_ARGS=(
   --output-dir "outputs/cpu_tiny_${BACKEND}"
   --save "outputs/cpu_tiny_${BACKEND}/ckpt"
   --save-interval 50
   --check-weight-sync
)

${RL_PLUGIN_TRAIN:-rl-plugin-train} "${CLUSTER_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${TRAIN_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
