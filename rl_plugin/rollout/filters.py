"""DAPO rollout control: dynamic-sampling group filters and over-long reward shaping.

Dynamic sampling (Yu et al. 2025, DAPO, sec. 3.2): a prompt group whose responses all get the
same reward has zero group-relative advantage and only dilutes the batch, so the rollout keeps
sampling prompts (``--over-sampling-batch-size`` per round) until ``--rollout-batch-size`` groups
pass the filter, and trains on those only. A filter is slime's
``fn(args, samples, **kwargs) -> bool`` (or an object with ``.keep``, like slime's
``DynamicFilterOutput``) over one group's ``FilterSample``s; it sees the RAW rewards, before any
shaping. Built-in: ``rl_plugin.rollout.filters.check_reward_nonzero_std`` (float64 std > 0).

Over-long shaping (DAPO, sec. 3.4, "soft overlong punishment"), with L_max =
``--rollout-max-response-len``, L_cache = ``--overlong-buffer-len`` and factor f =
``--overlong-penalty-factor``, added to the reward of a response of length |y|:

    R_len(y) = 0                                   if |y| <= L_max - L_cache
             = f * ((L_max - L_cache) - |y|) / L_cache    if L_max - L_cache < |y| <= L_max

(reaching -f at |y| = L_max; the engine never returns |y| > L_max, the paper's -1 branch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List

import torch

from rl_plugin.registries import BUILTIN_FILTER  # noqa: F401 - re-exported: the flag default names it
from rl_plugin.user_code import load_function


@dataclass(frozen=True)
class FilterSample:
    """What a filter sees of one response (the fields slime's ``Sample`` has under these names)."""

    prompt: str
    response: str
    label: object
    reward: float
    response_length: int
    truncated: bool

    def get_reward_value(self, args) -> float:  # slime's accessor
        return self.reward


def check_reward_nonzero_std(args, samples: List[FilterSample], **kwargs) -> bool:
    """Keep a group whose raw rewards are not all equal (float64 std > 0)."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    return bool(rewards.numel() > 1 and rewards.std() > 0)


def load_filter(path: str) -> Callable:
    return load_function(path, "--dynamic-sampling-filter-path")


def keep_decision(result) -> bool:
    """A filter's answer: a bool, or slime's ``DynamicFilterOutput`` (``.keep``)."""
    return bool(getattr(result, "keep", result))


def overlong_penalty(response_lengths: torch.Tensor, *, max_len: int, buffer_len: int, factor: float) -> torch.Tensor:
    """DAPO's soft over-long punishment per response (<= 0, float32, vectorised)."""
    expected = max_len - buffer_len
    over = (response_lengths.to(torch.float64) - expected).clamp_min(0.0)
    return (-factor * over / buffer_len).to(torch.float32)
