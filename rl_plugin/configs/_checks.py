"""Helpers of the configs' rules: a count that must be positive, a positive finite number (a user
function that must load: ``rl_plugin.user_code.check_importable``)."""

from __future__ import annotations

import math

from rl_plugin.errors import fail


def positive(flag: str, value, example: int = 8) -> None:
    """``flag``'s ``value``, when given, is a count >= 1."""
    if value is not None and value < 1:
        fail(flag, f"must be >= 1 (got {value})", f"use a positive count, e.g. {flag} {example}")


def is_positive_finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x) and x > 0
