"""Flags of what is measured and reported each step."""

from __future__ import annotations

from rl_plugin.arguments._util import add_flag


def add_arguments(parser):
    g = parser.add_argument_group("metrics", "What the policy-gradient step reports.")
    add_flag(
        g,
        "--pg-metrics",
        choices=["none", "basic", "with_entropy"],
        default="basic",
        help="Policy-gradient metrics per step: basic = old log-prob, ratio mean/sum/squared sum, KL(old||new), clip fraction, advantage mean/min/max, token count; with_entropy adds the token entropy (one extra reduction per token chunk). Diagnostics use the sample mean whatever --loss-aggregation is.",
    )
    return parser


def validate(args) -> None:
    """No combination of metric flags changes the objective."""
