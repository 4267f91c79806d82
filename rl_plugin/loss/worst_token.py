"""The step's worst token: the trained response token with the largest |old_t - rollout_t| (the
trainer's log-prob of the sampling policy against the engine's), for ``--ci-test`` with
``--ci-train-rollout-logprob-abs-diff-threshold`` (``rl_plugin.configs.ci_checks``; the loop
compares it with the threshold, ``rl_plugin.loop.ci_checks``).

``worst_token`` is one vectorised pass on the loss device (an argmax over the masked |d|, the
sample by a search over the response offsets); ``reduce_worst`` takes the largest over the DP x CP
group (one all-gather of 5 doubles per rank; a CP rank holds its full responses, as the mismatch
metrics' sums assume) and returns the step report's entries::

    mismatch/worst_sample            the sample's index in the rollout (``StepBatch.sample_index``;
                                     the step-local index when the batch has none)
    mismatch/worst_position          the token's position in that sample's response
    mismatch/worst_old_log_prob      the trainer's old log-prob there
    mismatch/worst_rollout_log_prob  the engine's

Its |d| is ``mismatch/abs_diff_max``. A step with no trained token on any rank reports None for all
four. Ties: the first token of the lowest rank with the largest |d|.

The same pair of functions names the worst token of |old - ref| for ``--ci-test``'s actor =
reference check (the first rollout's old log-probs are the reference model's: the same weights),
under ``ACTOR_REF_KEYS`` (``ci/actor_ref_worst_sample``, ``..._position``, ``..._old_log_prob``,
``..._ref_log_prob``).
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch
import torch.distributed as dist

from rl_plugin.cp import exclusive_cumsum

KEYS = (
    "mismatch/worst_sample",
    "mismatch/worst_position",
    "mismatch/worst_old_log_prob",
    "mismatch/worst_rollout_log_prob",
)
ACTOR_REF_KEYS = (
    "ci/actor_ref_worst_sample",
    "ci/actor_ref_worst_position",
    "ci/actor_ref_worst_old_log_prob",
    "ci/actor_ref_worst_ref_log_prob",
)


def worst_token(
    old: torch.Tensor,
    rollout: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths: torch.Tensor,
    sample_index: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[|d|, sample, position, old, rollout]`` (float64, on ``old``'s device) of the first trained
    token (``loss_mask > 0``) with the largest |d| = |old - rollout|; ``[-inf, -1, -1, nan, nan]``
    when there is none. ``sample`` is ``sample_index[i]`` for the batch's sample i (``i`` itself
    when ``sample_index`` is None); ``position`` counts from the response's first token."""
    device = old.device
    none = torch.tensor([-math.inf, -1.0, -1.0, math.nan, math.nan], dtype=torch.float64, device=device)
    if old.numel() == 0:
        return none
    o, r = old.detach().to(torch.float64), rollout.detach().to(device, torch.float64)
    d = torch.where(loss_mask.to(device) > 0, (o - r).abs(), o.new_full((), -math.inf))
    t = torch.argmax(d)  # the first maximal value
    lengths = response_lengths.to(device, torch.long)
    ends = torch.cumsum(lengths, 0)
    i = torch.searchsorted(ends, t, right=True)  # the sample whose response holds token t
    position = t - exclusive_cumsum(lengths)[i]
    sample = i if sample_index is None else sample_index.to(device, torch.long)[i]
    found = torch.stack([d[t], sample.to(torch.float64), position.to(torch.float64), o[t], r[t]])
    return torch.where(d[t] > -math.inf, found, none)


def reduce_worst(local: torch.Tensor, group, keys=KEYS) -> Dict[str, Optional[float]]:
    """The step report's entries (``keys``: sample, position, and the two log-probs) of the
    largest of every rank's ``worst_token`` over ``group`` (None: this rank's alone); collective:
    every rank of the group calls it."""
    v = local.detach().to("cpu", torch.float64).reshape(5)
    if group is not None:
        gathered = [torch.empty_like(v) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, v, group=group)
        rows = torch.stack(gathered)
        v = rows[int(torch.argmax(rows[:, 0]))]
    if not math.isfinite(float(v[0])):
        return dict.fromkeys(keys)
    return {key: float(x) for key, x in zip(keys, v[1:])}
