"""Helpers of the configs' rules: a count that must be positive, a user function that must load,
a positive finite number."""

from __future__ import annotations

import math

from rl_plugin.errors import RLArgumentError, fail
from rl_plugin.user_code import FORMS, UserCodeError, load_function


def positive(args, flag: str, example: int = 8) -> None:
    """``flag`` (its value read from ``args``), when given, is a count >= 1."""
    value = getattr(args, flag[2:].replace("-", "_"))
    if value is not None and value < 1:
        fail(flag, f"must be >= 1 (got {value})", f"use a positive count, e.g. {flag} {example}")


def importable(flag: str, path: str) -> None:
    """Load the function now (``rl_plugin.user_code``: the forms every user-function flag takes)."""
    try:
        load_function(path, flag)
    except UserCodeError as exc:  # the module raised while importing: names its file:line and the fix
        raise RLArgumentError(str(exc)) from None
    except ValueError as exc:
        reason = getattr(exc, "reason", str(exc))
        fix = (
            "correct the name after the ':' (or define that function in the module)"
            if "has no callable" in reason
            else f"pass {FORMS}, importable from here (PYTHONPATH)"
        )
        fail(flag, f"cannot load the function {path!r}: {reason}", fix)


def is_positive_finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x) and x > 0
