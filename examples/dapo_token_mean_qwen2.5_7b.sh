#!/usr/bin/env bash
# DAPO-style (Yu et al. 2025): token-mean loss over all tokens of the step (long responses weigh
# in proportion to their length), clip-higher (0.2 / 0.28), token-budget micro-batches, dynamic
# sampling (rounds of 128 prompts until 64 groups with reward variance are kept) and the soft
# over-long punishment over the last 4096 tokens of the 16384-token budget.
# 16 GPUs (2 nodes x 8), colocated: training and 8 vLLM engines of TP=2 time-share the same GPUs.
set -euo pipefail
MODEL_DIR=${MODEL_DIR:-/models/Qwen2.5-7B}
DATA_DIR=${DATA_DIR:-/data}

MODEL_ARGS=(--train-backend megatron --hf-checkpoint "$MODEL_DIR" --tensor-model-parallel-size 2 --bf16 --fp32-lm-head)
CLUSTER_ARGS=(--actor-num-nodes 2 --actor-num-gpus-per-node 8 --colocate --rollout-engine vllm --rollout-num-gpus-per-engine 2)
ROLLOUT_ARGS=(
   --prompt-data "$DATA_DIR/dapo-math-17k.jsonl"
   --apply-chat-template
   --rm-type math_exact
   --rollout-batch-size 64
   --n-samples-per-prompt 16
   --rollout-max-response-len 16384
   --num-rollout 2000
   --over-sampling-batch-size 128
   --dynamic-sampling-filter-path rl_plugin.rollout.dapo.filters.check_reward_nonzero_std
   --overlong-buffer-len 4096
   --overlong-penalty-factor 1.0
)
LOSS_ARGS=(
   --advantage-estimator grpo
   --loss-aggregation token_mean
   --eps-clip 0.2
   --eps-clip-high 0.28
)
TRAIN_ARGS=(
   --global-batch-size 512
   --use-dynamic-batch-size
   --max-tokens-per-gpu 18432
   --lr 1e-6
   --weight-decay 0.1
   --use-distributed-optimizer
)
OUTPUT_ARGS=(--save /ckpt/dapo-7b --load /ckpt/dapo-7b --save-interval 50)

${RL_PLUGIN_TRAIN:-rl-plugin-train} "${MODEL_ARGS[@]}" "${CLUSTER_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${LOSS_ARGS[@]}" "${TRAIN_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
