"""Flags of fault tolerance: how often the loop restarts a dead rollout engine before giving up."""

from __future__ import annotations

from rl_plugin.arguments._util import add_flag, fail


def add_arguments(parser):
    g = parser.add_argument_group("fault tolerance", "What the loop does when a worker dies mid-run.")
    add_flag(
        g,
        "--max-rollout-retries",
        type=int,
        default=3,
        help=(
            "When the rollout engine's actor dies (a crashed or killed process, a lost node), restart it, load the "
            "current weights into it and retry the rollout, at most this many times per run; generation is seeded "
            "per rollout, so a retried rollout yields the same samples. Beyond it the run stops naming the engine, "
            "the cause and the --load command. 0 stops at the first death. Errors raised inside a rollout (a "
            "reward function, bad data) are never retried: they would fail again."
        ),
    )
    return parser


def validate(args) -> None:
    n = args.max_rollout_retries
    if n is None or n < 0:
        fail(
            "--max-rollout-retries",
            f"must be >= 0 (got {n})",
            "use 0 to stop at the first engine death, or a small count such as 3",
        )
