#!/usr/bin/env bash
# SFT on a CPU (issue 35): SmolLM2-135M-Instruct learns the addition task's answers
# (examples/addition_data.py: system + user messages, the sum as --label-key, appended as the
# assistant turn) with --loss-type sft_loss: the NLL of the assistant tokens (the answer and its
# <|im_end|>), no rollout engine. The --save-hf output then starts the RL run:
#
#   bash examples/sft_smollm2.sh                       # -> outputs/smollm2_sft/hf
#   bash examples/real_model_smollm2.sh --hf-checkpoint outputs/smollm2_sft/hf   # SFT then RL
#   TEACHER=outputs/smollm2_sft/hf bash examples/opd_smollm2.sh                  # or distil it
#
# BACKEND=megatron|fsdp; extra arguments go to rl-plugin-train. PREPARE=0 skips the model fetch and
# the data (tests/fast/cli/test_examples.py checks the flags this way).
set -euo pipefail
cd "$(dirname "$0")/.."
BACKEND=${BACKEND:-fsdp}
PY=${PYTHON:-python}
OUT=${OUT:-outputs/smollm2_sft}

CKPT=${RL_PLUGIN_CACHE:-${HOME:-.}/.cache/rl_plugin}/smollm2-135m-instruct-float32
DATA="$OUT/data"
if [ "${PREPARE:-1}" != 0 ]; then
   CKPT=$("$PY" -m rl_plugin.models.smollm2 | tail -1)
   "$PY" examples/addition_data.py "$DATA" >/dev/null
fi

${RL_PLUGIN_TRAIN:-rl-plugin-train} \
   --hf-checkpoint "$CKPT" \
   --train-backend "$BACKEND" \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node 1 \
   --loss-type sft_loss \
   --prompt-data "$DATA/train.jsonl" \
   --input-key messages \
   --label-key label \
   --apply-chat-template \
   --rollout-shuffle \
   --rollout-batch-size 16 \
   --num-rollout 8 \
   --eval-prompt-data "$DATA/eval.jsonl" \
   --eval-interval 4 \
   --global-batch-size 16 \
   --micro-batch-size 8 \
   --calculate-per-token-loss \
   --lr 2e-5 \
   --save "$OUT/ckpt" \
   --save-hf "$OUT/hf" \
   --output-dir "$OUT" \
   "$@"
