#!/usr/bin/env bash
# On-policy distillation on a CPU (issue 35): a fresh SmolLM2-135M-Instruct student samples the
# addition task and a teacher scores every sampled token; the advantage becomes
# GRPO's - coef * (log p_student - log p_teacher) (--use-opd). The teacher here is the SFT'd
# SmolLM2 of examples/sft_smollm2.sh (TEACHER=its --save-hf directory): the same tokenizer, as OPD
# requires. OPD_TYPE=megatron runs the teacher in the train actor (forward only), hf / vllm beside
# the rollout engine. BACKEND=megatron|fsdp; extra arguments go to rl-plugin-train; PREPARE=0 skips
# the model fetch and the data.
set -euo pipefail
cd "$(dirname "$0")/.."
BACKEND=${BACKEND:-fsdp}
OPD_TYPE=${OPD_TYPE:-megatron}
PY=${PYTHON:-python}
OUT=${OUT:-outputs/smollm2_opd_${OPD_TYPE}}
TEACHER=${TEACHER:-outputs/smollm2_sft/hf}

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
   --use-opd \
   --opd-type "$OPD_TYPE" \
   --opd-teacher-load "$TEACHER" \
   --opd-kl-coef 1.0 \
   --prompt-data "$DATA/train.jsonl" \
   --input-key messages \
   --label-key label \
   --apply-chat-template \
   --rm-type math_exact \
   --rollout-shuffle \
   --rollout-batch-size 4 \
   --n-samples-per-prompt 8 \
   --rollout-max-response-len 16 \
   --num-rollout 10 \
   --eval-prompt-data "$DATA/eval.jsonl" \
   --eval-interval 5 \
   --global-batch-size 32 \
   --micro-batch-size 8 \
   --lr 2e-5 \
   --output-dir "$OUT" \
   "$@"
