"""Megatron-LM flags the plugin reads, for when Megatron-LM's own parser is not in use (those not
yet declared on a typed config: the checkpoint and logging ones).

megatron-core on PyPI ships no ``megatron.training``; our parser then defines these flags itself,
spelled and defaulted as Megatron-LM spells them, so a training shell ports over unchanged. When
``add_rl_arguments`` runs as Megatron-LM's ``extra_args_provider``, this module is not used. The
other Megatron-LM flags are declared on the configs that own them (``rl_plugin.flags.MEGATRON``).
"""

from __future__ import annotations

import math

from rl_plugin.arguments._util import add_flag, fail


def add_arguments(parser):
    g = parser.add_argument_group(
        "megatron", "Megatron-LM flags (defined here only when Megatron-LM's parser is absent)"
    )
    add_flag(g, "--save", type=str, default=None, help="Checkpoint directory to save to (Megatron-LM).")
    add_flag(g, "--load", type=str, default=None, help="Checkpoint directory to resume from (Megatron-LM).")
    add_flag(
        g,
        "--save-interval",
        type=int,
        default=None,
        help="Save a checkpoint every N rollouts (Megatron-LM spells it in steps; rl-plugin-train saves between rollouts, so that resume restores the dataset position too), and always after the last rollout.",
    )
    add_flag(
        g,
        "--log-interval",
        type=int,
        default=1,
        help="Print a one-line summary of the training metrics (reward, loss, grad norm, step timings) every N optimizer steps, with or without the progress bar.",
    )
    return parser


# (flag, attribute, lowest allowed, lowest is allowed, highest (exclusive) or None, example fix)
RANGES = (
    ("--save-interval", "save_interval", 1, True, None, "--save-interval 10 (rollouts)"),
    ("--log-interval", "log_interval", 1, True, None, "--log-interval 1"),
)


def _in_range(value, low, low_ok: bool, high) -> bool:
    if not math.isfinite(value):
        return False
    return (value >= low if low_ok else value > low) and (high is None or value < high)


def validate(args) -> None:
    """Ranges of the Megatron-LM flags the plugin reads (Megatron-LM itself does not check them). A
    flag Megatron-LM's parser lacks (when this runs as its ``extra_args_provider``) is skipped."""
    for flag, attr, low, low_ok, high, example in RANGES:
        value = getattr(args, attr, None)
        if value is None:
            continue
        if not _in_range(value, low, low_ok, high):
            interval = (
                f"{'[' if low_ok else '('}{low}, {high})"
                if high is not None
                else (f">= {low}" if low_ok else f"> {low}")
            )
            fail(flag, f"must be {'in ' if high is not None else ''}{interval} (got {value})", f"use e.g. {example}")
    if getattr(args, "save_interval", None) is not None and getattr(args, "save", "unset") is None:
        fail(
            "--save-interval without --save",
            "there is no checkpoint directory, so the interval would be silently ignored",
            "add --save DIR, or drop --save-interval",
        )
