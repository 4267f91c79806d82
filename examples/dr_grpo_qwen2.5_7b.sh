#!/usr/bin/env bash
# Dr.GRPO (Liu et al. 2025): group-mean baseline without std normalisation, and every sample's
# token sum divided by ONE constant (the max response length) instead of its own length, which
# removes GRPO's length bias. 8 GPUs training (TP=2 x DP=4) + 8 GPUs SGLang rollout (8 engines of 1 GPU).
set -euo pipefail
MODEL_DIR=${MODEL_DIR:-/models/Qwen2.5-7B}
DATA_DIR=${DATA_DIR:-/data}
MAX_RESPONSE_LEN=4096

MODEL_ARGS=(--train-backend megatron --hf-checkpoint "$MODEL_DIR" --tensor-model-parallel-size 2 --bf16)
CLUSTER_ARGS=(--actor-num-nodes 1 --actor-num-gpus-per-node 8 --rollout-num-gpus 8 --rollout-num-gpus-per-engine 1 --rollout-engine sglang)
ROLLOUT_ARGS=(
   --prompt-data "$DATA_DIR/math-12k.jsonl"
   --input-key problem
   --label-key answer
   --rm-type math_exact
   --rollout-batch-size 64
   --n-samples-per-prompt 8
   --rollout-max-response-len "$MAX_RESPONSE_LEN"
   --num-rollout 1000
)
LOSS_ARGS=(
   --advantage-estimator dr_grpo
   --loss-aggregation constant
   --loss-aggregation-divisor "$MAX_RESPONSE_LEN"
   --eps-clip 0.2
)
TRAIN_ARGS=(
   --global-batch-size 512
   --micro-batch-size 4
   --lr 1e-6
   --clip-grad 1.0
   --use-distributed-optimizer
)
OUTPUT_ARGS=(--save /ckpt/dr-grpo-7b --load /ckpt/dr-grpo-7b --save-interval 50)

${RL_PLUGIN_TRAIN:-rl-plugin-train} "${MODEL_ARGS[@]}" "${CLUSTER_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${LOSS_ARGS[@]}" "${TRAIN_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
