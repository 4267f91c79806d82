"""DAPO rollout control: dynamic-sampling group filters and over-long reward shaping.

Dynamic sampling (Yu et al. 2025, DAPO, sec. 3.2): a prompt group whose responses all get the
same reward has zero group-relative advantage and only dilutes the batch, so the rollout keeps
sampling prompts (``--over-sampling-batch-size`` per round) until ``--rollout-batch-size`` groups
pass the filter, and trains on those only. A filter is slime's
``fn(args, samples, **kwargs) -> bool`` (or an object with ``.keep``, like slime's
``DynamicFilterOutput``) over one group's ``Sample``s (``rl_plugin.rollout.sample``, scored:
``sample.reward`` as the reward gave it, ``sample.get_reward_value(args)`` its number); it sees
the RAW rewards, before any shaping. ``args`` is the ``RolloutConfig`` (slime's names). The answer must be a ``bool`` (``numpy.bool_`` is accepted too: it is what a numpy
comparison returns, and it has one truth value); anything else stops the rollout at the first
group with the filter's flag, file:line, the value and its type (``keep_decision``). Built-in:
``rl_plugin.rollout.dapo.filters.check_reward_nonzero_std`` (float64 std > 0).

Over-long shaping (DAPO, sec. 3.4, "soft overlong punishment"), with L_max =
``--rollout-max-response-len``, L_cache = ``--overlong-buffer-len`` and factor f =
``--overlong-penalty-factor``, added to the reward of a response of length |y|:

    R_len(y) = 0                                   if |y| <= L_max - L_cache
             = f * ((L_max - L_cache) - |y|) / L_cache    if L_max - L_cache < |y| <= L_max

(reaching -f at |y| = L_max, and -f beyond it, the paper's -1 branch: a multi-turn response's
model tokens can exceed L_max, each turn having its own budget). |y| counts the model's tokens
(the loss mask's sum): tool output a custom generate hook appended is not the model's length.
"""

from __future__ import annotations

from typing import Callable, List

import numpy as np
import torch

from rl_plugin.registries import BUILTIN_FILTER  # noqa: F401 - re-exported: the flag default names it
from rl_plugin.rollout.sample import Sample
from rl_plugin.user_code import load_function, where


def check_reward_nonzero_std(args, samples: List[Sample], **kwargs) -> bool:
    """Keep a group whose raw rewards are not all equal: float64 std > 0 of the rewards as the
    trainer receives them (fp32, ``RolloutData.rewards``)."""
    values = [float(s.get_reward_value(args)) for s in samples]
    rewards = torch.tensor(values, dtype=torch.float32).to(torch.float64)
    return bool(rewards.numel() > 1 and rewards.std() > 0)


class FilterResultError(TypeError):
    """A dynamic-sampling filter returned something other than a bool; the message names the
    filter (flag and file:line), the value and its type, and the fix."""


class GroupFilter:
    """``--dynamic-sampling-filter-path``'s function, with where it came from (for messages).
    ``keep(cfg, samples)`` calls it on one group and returns its decision as a Python bool."""

    def __init__(self, fn: Callable, spec: str):
        self.fn, self.spec = fn, spec

    def describe(self) -> str:
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        return f"--dynamic-sampling-filter-path {self.spec} (function {name} at {where(self.fn)})"

    def keep(self, cfg, samples: List[Sample]) -> bool:
        return keep_decision(self.fn(cfg, samples), self.describe, len(samples))


def load_filter(path: str) -> GroupFilter:
    """The filter at ``path`` (any form of ``rl_plugin.user_code.FORMS``)."""
    return GroupFilter(load_function(path, "--dynamic-sampling-filter-path"), path)


def _why_not_bool(value) -> str:
    """The fix for a filter result that is not a bool."""
    if value is None:
        return "a path through the function ends without `return` (None would reject every group); return True or False on every path"
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and value.dtype == torch.bool:
            return "return the Python bool of the 0-dim tensor: `return (...).item()`"
        return "reduce it to one decision and return its Python bool, e.g. `return bool((rewards.std() > 0).item())`"
    if isinstance(value, str):
        return f"return True or False, not a string (bool({value!r}) is {bool(value)}: any non-empty string would keep the group)"
    return f"return True or False (e.g. `return count > 0`), not a value of type {type(value).__name__}"


def keep_decision(
    result, describe: Callable[[], str] = lambda: "the dynamic-sampling filter", group_size: int = 0
) -> bool:
    """A filter's answer as a Python bool. Accepted: ``bool``, ``numpy.bool_`` (the exact result of
    a numpy comparison, e.g. ``np.std(r) > 0``), or slime's ``DynamicFilterOutput`` whose ``.keep``
    is one of those. Anything else (None from a missing ``return``, a string, an int, a tensor,
    a 0-dim bool tensor included) raises ``FilterResultError`` at once: ``bool()`` of it would
    silently keep or drop every group, or fail without naming the filter."""
    value = getattr(result, "keep", result)
    if isinstance(value, bool):  # the common case first: one isinstance per group
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    held = f" (.keep of a {type(result).__name__})" if value is not result else ""
    raise FilterResultError(
        f"{describe()} returned {value!r} of type {type(value).__module__}.{type(value).__qualname__}{held} for a group of "
        f"{group_size} samples; a filter must return a bool (True keeps the group). Fix: {_why_not_bool(value)}"
    )


def overlong_penalty(response_lengths: torch.Tensor, *, max_len: int, buffer_len: int, factor: float) -> torch.Tensor:
    """DAPO's soft over-long punishment per response (<= 0, float32, vectorised)."""
    expected = max_len - buffer_len
    over = (response_lengths.to(torch.float64) - expected).clamp(0.0, float(buffer_len))
    return (-factor * over / buffer_len).to(torch.float32)
