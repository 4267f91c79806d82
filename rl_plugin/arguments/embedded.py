"""The flag defaults of the embedded default run, the rule that picks it, and the two-pass parse
that applies them.

``rl-plugin-train`` with neither ``--hf-checkpoint`` nor ``--prompt-data`` runs the embedded task
(``rl_plugin.loop.embedded_setup`` builds its model and data); so does a ``--hf-checkpoint`` of the
embedded family (a checkpoint with the character tokenizer, ``char_tokenizer.json``: it reads only
the task's digits, e.g. the tiny MoE the end-to-end tests train). Any other ``--hf-checkpoint``
without ``--prompt-data`` is refused (``check_model_and_data``): the digit task, its reward and its
lr 3e-3 would silently train a user's model on the wrong objective. ``--prompt-data`` without
``--hf-checkpoint`` is refused too (there is no model to train). The defaults live here, at the
bottom layer, so ``python -m rl_plugin.arguments`` resolves and checks a command line exactly as the
trainer will. Any flag given explicitly wins.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from rl_plugin.arguments import build_parser, validate_rl_args, with_loss_type_defaults
from rl_plugin.errors import fail

EMBEDDED_TASK_DIGITS = 3  # the digit-copy task copies this many digits (+ <eos>)

# argparse dests -> defaults of the embedded run. Tuned on a 2-core CPU (benchmarks/embedded_default.py).
EMBEDDED_DEFAULTS = dict(
    rollout_batch_size=16,
    n_samples_per_prompt=8,
    rollout_max_response_len=EMBEDDED_TASK_DIGITS + 1,
    num_rollout=300,
    micro_batch_size=128,
    lr=3e-3,
    eps_clip_high=0.28,
    rm_type="digit_match",
    eval_interval=25,
    n_samples_per_eval=1,
    log_interval=10,  # 300 one-step rollouts: a summary line every 10 keeps the terminal readable
)


# --lora-rank on the embedded run: the learning rate times this. LoRA's first steps move each weight
# by ~(alpha/r) * lr * sqrt(r / (3 * in)) (Adam moves B by ~lr, A ~ U(+-1/sqrt(in)), B = 0), the full
# model's Adam by ~lr: matching them takes lr * sqrt(3 * in / r) / (alpha / r), ~9x at Qwen2-0.5B's
# in = 896 and ~20x at 4096 (the usual "LoRA needs ~10x"), but only 2.4x at the embedded model's
# in = 64. Measured on the embedded task (FSDP, r 8, alpha 16, 300 rollouts): 10x and 3.3x collapse
# the policy within ~10 rollouts (reward flat at ~0.1), 5/3x (lr 5e-3) learns (0.11 -> 0.61).
LORA_LR_FACTOR = 5.0 / 3.0

# --advantage-estimator ppo on the embedded run: PPO's own settings over the defaults above (a learned
# critic instead of the group baseline). Measured on the embedded task (docs/benchmarks.md, "PPO with a
# critic"): whitened GAE advantages learn as fast as GRPO's; a few critic-only rollouts first let the
# zero-initialised value head fit the initial policy's returns before it becomes the baseline.
PPO_EMBEDDED_DEFAULTS = dict(normalize_advantages=True, num_critic_only_steps=3)

CHAR_TOKENIZER_FILE = "char_tokenizer.json"  # rollout.data.tokenizer.FILENAME: the embedded family's tokenizer


def is_embedded_family(hf_checkpoint: Optional[str]) -> bool:
    """A checkpoint built for the digit task (``rl_plugin.models.tiny`` + the character tokenizer)."""
    return hf_checkpoint is not None and (Path(hf_checkpoint) / CHAR_TOKENIZER_FILE).is_file()


def is_embedded(args) -> bool:
    """The run takes the embedded task (its data, reward and defaults): no ``--prompt-data``, and no
    ``--hf-checkpoint`` or one of the embedded family."""
    return args.prompt_data is None and (args.hf_checkpoint is None or is_embedded_family(args.hf_checkpoint))


def check_model_and_data(args) -> None:
    """Refuse a model without data and data without a model (``RLArgumentError``, exit 2). The
    checker and preflight run both; the trainer's parse the first (``check_model_without_data``),
    so that a parse alone still accepts data without a model (tests parse such command lines)."""
    check_model_without_data(args)
    if args.prompt_data is not None and args.hf_checkpoint is None:
        fail(
            f"--prompt-data {args.prompt_data} without --hf-checkpoint",
            "the loop needs a model to train (the embedded tiny model reads only the digit task's characters)",
            "pass --hf-checkpoint DIR (a Hugging Face model directory)",
        )


def check_model_without_data(args) -> None:
    """A ``--hf-checkpoint`` outside the embedded family with no ``--prompt-data``: refused."""
    if args.prompt_data is None and not is_embedded(args):
        d = EMBEDDED_DEFAULTS
        fail(
            f"--hf-checkpoint {args.hf_checkpoint} without --prompt-data",
            "with no --prompt-data the run takes the embedded default's digit-copy task (its prompts, --rm-type "
            f"{d['rm_type']}, --lr {d['lr']:g}, --num-rollout {d['num_rollout']}, --micro-batch-size "
            f"{d['micro_batch_size']}), which is made for the embedded tiny model (a checkpoint with "
            f"{CHAR_TOKENIZER_FILE}, which this one lacks): it would train your model on the wrong task",
            "pass --prompt-data FILE (JSONL or Parquet; the prompt under --input-key, the label under --label-key) with "
            "--rollout-batch-size N --rollout-max-response-len N --num-rollout N and a reward (--rm-type math_exact, "
            "or --custom-rm-path file.py:rm), plus --apply-chat-template for an instruction-tuned model; or drop "
            "--hf-checkpoint to run the embedded demo",
        )


def parse_train_flags(argv: Optional[List[str]] = None, *, prog: str = "rl-plugin-train"):
    """Parse and validate (phase 1) a trainer command line, with the embedded defaults when it
    runs the embedded task (``is_embedded``); a model without data, or data without a model, is
    refused (``check_model_without_data``; data without a model: by the checker and preflight)."""
    parser = build_parser(prog=prog)
    first = parser.parse_args(argv)
    check_model_without_data(first)
    if is_embedded(first):  # the embedded default: its own defaults, explicit flags win
        defaults = dict(EMBEDDED_DEFAULTS)
        if first.custom_rm_path is not None:
            defaults.pop("rm_type")  # the user's reward replaces the built-in one
        if first.lora_rank > 0:  # LoRA's learning rate (LORA_LR_FACTOR)
            defaults["lr"] = LORA_LR_FACTOR * EMBEDDED_DEFAULTS["lr"]
        if first.advantage_estimator == "ppo":  # PPO with a critic: its own settings (PPO_EMBEDDED_DEFAULTS)
            defaults.update(PPO_EMBEDDED_DEFAULTS)
        parser.set_defaults(**defaults)
        first = parser.parse_args(argv)
    first = with_loss_type_defaults(parser, first, argv)
    return validate_rl_args(first)
