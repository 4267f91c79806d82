"""Helpers shared by the flag modules: idempotent flag registration and the error type."""

from __future__ import annotations

import math


class RLArgumentError(ValueError):
    """A flag combination that would train the wrong objective. The message names the flags,
    the rule and the fix."""


def has_flag(parser, flag: str) -> bool:
    """True if the parser (or argument group) defines ``flag``; argparse has no public lookup."""
    return flag in parser._option_string_actions


def add_flag(group, *names: str, **kwargs) -> None:
    """Add a flag unless the parser already defines it (Megatron-LM's parser defines its own
    flags, e.g. ``--calculate-per-token-loss``; we read theirs instead of redefining them)."""
    if any(has_flag(group, n) for n in names):  # a group shares its parser's option table
        return
    group.add_argument(*names, **kwargs)


def is_positive_finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def fail(flags: str, rule: str, fix: str) -> None:
    raise RLArgumentError(f"{flags}: {rule}. Fix: {fix}.")
