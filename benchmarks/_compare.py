"""What the benchmarks that race rl_plugin against a baseline share: the step and loop time at
which a run's reward first reaches a threshold, number cells, ratios, and ``NAME=FLAGS`` variants."""

from __future__ import annotations

import shlex
from typing import List, Optional, Tuple


def first_reaching(rewards: List[float], step_s: List[float], threshold: float, window: int):
    """(step, loop seconds) at which the trailing ``window``-step mean reward first reaches ``threshold``."""
    for i in range(window - 1, len(rewards)):
        if sum(rewards[i - window + 1 : i + 1]) / window >= threshold:
            return i + 1, sum(step_s[: i + 1])
    return None, None


def fmt(x: Optional[float], spec: str) -> str:
    width = int("".join(c for c in spec.split(".")[0] if c.isdigit()) or 0)
    return format(x, spec) if x is not None else "-".rjust(width)


def ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def parse_variants(specs: Optional[List[str]], extra: List[str]) -> List[Tuple[str, List[str]]]:
    """``NAME=FLAGS`` (``--variant overlap='--max-weight-staleness 1 --use-tis'``) -> (name, argv);
    the flags after ``--`` apply to every variant. None: one variant, ``sync``, of those flags."""
    if not specs:
        return [("", list(extra))]
    out = []
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name:
            raise SystemExit(f"--variant {spec!r}: expected NAME=FLAGS, e.g. overlap='--max-weight-staleness 1'")
        out.append((name, [*extra, *shlex.split(flags)]))
    return out
