"""Flags of how a rollout is cut into optimizer steps and micro-batches."""

from __future__ import annotations

from rl_plugin.arguments._util import add_flag, fail
from rl_plugin.arguments.aggregation import resolved_mode
from rl_plugin.arguments.policy import GROUP_RELATIVE


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def add_arguments(parser):
    g = parser.add_argument_group("batching", "How rollouts become optimizer steps and micro-batches.")
    add_flag(
        g,
        "--n-samples-per-prompt",
        type=int,
        default=8,
        help="Responses sampled per prompt; one prompt's responses form a group for group-relative advantages and prompt_mean.",
    )
    add_flag(
        g,
        "--docs-per-step",
        type=int,
        default=None,
        help="Size a step by documents instead of --global-batch-size: a step ends once the global document count reaches this target (micro-batches are accumulated until it does). For token-budget micro-batching (--use-dynamic-batch-size), where a fixed sample count per step does not fit.",
    )
    add_flag(
        g,
        "--qkv-format",
        choices=["thd", "bshd"],
        default="thd",
        help="Sequence layout: thd packs samples back to back (no padding waste; needs varlen attention), bshd pads every sample to --seq-length.",
    )
    add_flag(
        g,
        "--use-dynamic-batch-size",
        action="store_true",
        help="Form micro-batches by a token budget (--max-tokens-per-gpu) instead of --micro-batch-size, as in slime.",
    )
    add_flag(
        g,
        "--max-tokens-per-gpu",
        type=int,
        default=None,
        help="Token budget of one micro-batch with --use-dynamic-batch-size.",
    )
    return parser


def validate(args) -> None:
    n = args.n_samples_per_prompt
    if n < 1:
        fail("--n-samples-per-prompt", f"must be >= 1 (got {n})", "use e.g. --n-samples-per-prompt 8")
    if args.advantage_estimator in GROUP_RELATIVE and n < 2:
        baseline = "leave-one-out mean" if args.advantage_estimator == "rloo" else "group mean"
        fail(
            f"--n-samples-per-prompt {n} with --advantage-estimator {args.advantage_estimator}",
            f"the advantage subtracts the {baseline} of the prompt's samples, so a group of one sample has advantage 0 "
            "and every optimizer step is a no-op (>= 2 samples per prompt needed)",
            "use --n-samples-per-prompt >= 2 (GRPO recipes use 8-16)",
        )
    if args.docs_per_step is not None:
        if args.docs_per_step < 1:
            fail("--docs-per-step", f"must be >= 1 (got {args.docs_per_step})", "use a positive document count")
        if args.global_batch_size is not None:
            fail(
                "--docs-per-step with --global-batch-size",
                "a step is sized by one or the other: docs-per-step ends a step once the global document count reaches its target",
                "drop one of the two flags",
            )
        if resolved_mode(args) == "prompt_mean":
            fail(
                "--loss-aggregation prompt_mean with --docs-per-step",
                "a docs-per-step boundary falls wherever the document count crosses the target and can split a prompt group across two optimizer steps",
                f"size steps with --global-batch-size, a multiple of --n-samples-per-prompt ({n})",
            )
    gbs = args.global_batch_size
    if gbs is not None and gbs < 1:
        fail("--global-batch-size", f"must be >= 1 (got {gbs})", "use a positive sample count")
    rollout = args.rollout_batch_size * n if args.rollout_batch_size is not None else None
    if gbs is not None and rollout is not None and args.docs_per_step is None and rollout % gbs != 0:
        fail(
            f"--global-batch-size {gbs}",
            f"a rollout of --rollout-batch-size x --n-samples-per-prompt = {args.rollout_batch_size} x {n} = {rollout} samples must split into whole optimizer steps",
            f"use a --global-batch-size that divides {rollout}, e.g. {_largest_divisor_at_most(rollout, gbs)}",
        )
    if resolved_mode(args) == "prompt_mean" and gbs is not None and gbs % n != 0:
        fail(
            f"--loss-aggregation prompt_mean with --global-batch-size {gbs} and --n-samples-per-prompt {n}",
            "a step must never split a prompt group, so the global batch must be a multiple of the group size",
            f"use --global-batch-size {max(n, gbs // n * n)} or {(gbs // n + 1) * n}",
        )
    if args.context_parallel_size > 1 and args.qkv_format == "bshd" and args.seq_length is None:
        fail(
            f"--context-parallel-size {args.context_parallel_size} with --qkv-format bshd",
            "bshd chunks every sample by the padded length, which is --seq-length, and it is missing",
            "pass --seq-length (the padded length), or use --qkv-format thd",
        )
    if args.use_dynamic_batch_size and not args.max_tokens_per_gpu:
        fail("--use-dynamic-batch-size", "needs a token budget per micro-batch", "pass --max-tokens-per-gpu N")
    if args.max_tokens_per_gpu is not None and args.max_tokens_per_gpu < 1:
        fail("--max-tokens-per-gpu", f"must be >= 1 (got {args.max_tokens_per_gpu})", "use a positive token budget")
    if args.micro_batch_size is not None and args.micro_batch_size < 1:
        fail("--micro-batch-size", f"must be >= 1 (got {args.micro_batch_size})", "use a positive sample count")


def validate_world(args, *, dp_size: int) -> None:
    """Checks that need the data-parallel size (known once the world is up)."""
    gbs = args.global_batch_size
    if gbs is not None and not args.use_dynamic_batch_size:
        mbs = args.micro_batch_size
        if gbs % (mbs * dp_size) != 0:
            fail(
                f"--global-batch-size {gbs} with --micro-batch-size {mbs} on {dp_size} data-parallel ranks",
                "every data-parallel rank must run a whole number of micro-batches per step",
                f"make --global-batch-size a multiple of micro-batch-size x DP = {mbs * dp_size}",
            )
