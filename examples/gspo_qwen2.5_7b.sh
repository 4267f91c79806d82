#!/usr/bin/env bash
# GSPO (Zheng et al. 2025) on a Qwen2.5-7B-class model: sequence-level, length-normalised importance
# ratio with a tight clip (3e-4 / 4e-4), sample_mean aggregation (the paper's objective).
# 8 GPUs for training (TP=2 x DP=4) + 8 GPUs for SGLang rollout (4 engines of TP=2), Megatron backend.
set -euo pipefail
MODEL_DIR=${MODEL_DIR:-/models/Qwen2.5-7B-Instruct}
DATA_DIR=${DATA_DIR:-/data}

MODEL_ARGS=(
   --train-backend megatron
   --hf-checkpoint "$MODEL_DIR"
   --tensor-model-parallel-size 2
   --sequence-parallel
   --bf16
   --fp32-lm-head
)
CLUSTER_ARGS=(
   --actor-num-nodes 1
   --actor-num-gpus-per-node 8
   --rollout-num-gpus 8
   --rollout-num-gpus-per-engine 2
   --rollout-engine sglang
   --update-weight-buffer-size 536870912
)
ROLLOUT_ARGS=(
   --prompt-data "$DATA_DIR/dapo-math-17k.jsonl"
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type math_exact
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-response-len 8192
   --rollout-temperature 1.0
   --num-rollout 3000
   --eval-interval 20
   --eval-prompt-data "$DATA_DIR/aime-2024.jsonl"
   --n-samples-per-eval 16
)
GSPO_ARGS=(
   --advantage-estimator gspo
   --loss-aggregation sample_mean
   --eps-clip 3e-4
   --eps-clip-high 4e-4
)
TRAIN_ARGS=(
   --global-batch-size 256
   --use-dynamic-batch-size
   --max-tokens-per-gpu 9216
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
   --clip-grad 1.0
   --use-distributed-optimizer
)
OUTPUT_ARGS=(
   --save /ckpt/gspo-qwen2.5-7b
   --load /ckpt/gspo-qwen2.5-7b
   --save-interval 20
   --tensorboard-dir /ckpt/gspo-qwen2.5-7b/tb
)

${RL_PLUGIN_TRAIN:-rl-plugin-train} "${MODEL_ARGS[@]}" "${CLUSTER_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${GSPO_ARGS[@]}" "${TRAIN_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
