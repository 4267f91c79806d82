#!/usr/bin/env bash
# Vision-language RL on a CPU (issue 46): a tiny random Qwen2.5-VL (`python -m
# rl_plugin.models.tiny_vl`, built locally: vision tower, processor, tokenizer, chat template)
# learns to name the colour of a solid image (`rl_plugin.rollout.data.vl_task`): every prompt has
# the same text, only the image tells the label, so a reward above chance (1 / NUM_COLOURS) proves
# the pixels reach the engine and the trainer. FSDP + the hf engine; ~2.5 min for 40 rollouts
# (docs/benchmarks.md "Vision-language RL"). `--rollout-engine vllm` runs it on vLLM (~1 min),
# `--train-backend megatron` trains it on Megatron (mbridge's Qwen2.5-VL on local specs).
#
# NUM_COLOURS=2..4; extra arguments go to rl-plugin-train. PREPARE=0 skips building the model and
# the data (tests/fast/cli/test_examples.py checks the flags this way).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-outputs/vl_colours}
CKPT="$OUT/tiny-vl"
DATA="$OUT/data"
if [ "${PREPARE:-1}" != 0 ]; then
   "$PY" -m rl_plugin.models.tiny_vl "$CKPT" >/dev/null
   "$PY" -m rl_plugin.rollout.data.vl_task "$DATA" "${NUM_COLOURS:-2}" >/dev/null
fi

${RL_PLUGIN_TRAIN:-rl-plugin-train} \
   --train-backend fsdp \
   --hf-checkpoint "$CKPT" \
   --prompt-data "$DATA/train.jsonl" \
   --eval-prompt-data "$DATA/eval.jsonl" \
   --multimodal-keys '{"image": "images"}' \
   --apply-chat-template \
   --custom-rm-path rl_plugin.rollout.data.vl_task:colour_reward \
   --rollout-batch-size 8 \
   --n-samples-per-prompt 8 \
   --rollout-max-response-len 1 \
   --num-rollout 40 \
   --eval-interval 10 \
   --n-samples-per-eval 4 \
   --global-batch-size 64 \
   --micro-batch-size 16 \
   --lr 3e-3 \
   --check-weight-sync \
   --output-dir "$OUT/run" \
   "$@"
