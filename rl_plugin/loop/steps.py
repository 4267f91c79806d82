"""From one rollout to per-rank step batches.

Advantages are computed ONCE per rollout by the loss core over whole prompt groups (a rollout
always holds whole groups), then the rollout is cut into optimizer steps:

- ``--global-batch-size B`` (default: the whole rollout): step k is samples ``[kB, (k+1)B)``;
  each step's samples are split over DP ranks with ``batching.split_samples_for_dp`` and its
  group ids renumbered step-locally (a group may straddle ranks; the loss core's counts are
  global). The number of samples per rollout must be a multiple of B.
- ``--docs-per-step``: each rank gets its ``split_samples_for_dp`` share of the whole rollout and
  plans micro-batches and steps itself (``TrainActor.plan_docs_steps``, collective over DP).

Every rank's samples of all its steps are concatenated in step order, so the rank computes old
log-probs in one pass before its first step and each step is a contiguous slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

from rl_plugin.arguments._util import fail
from rl_plugin.batching import split_samples_for_dp
from rl_plugin.loss import StepBatch, compute_advantages, to_tokens
from rl_plugin.rollout.manager import RolloutData


def rollout_batch(data: RolloutData, estimator: str) -> StepBatch:
    """The whole rollout as one StepBatch with advantages (group ids: rollout prompt index)."""
    loss_mask = torch.ones(int(data.response_lengths.sum()), dtype=torch.float32)
    adv = compute_advantages(estimator, data.rewards, data.group_ids, response_lengths=data.response_lengths, loss_mask=loss_mask)
    return StepBatch(
        tokens=data.tokens, total_lengths=data.total_lengths, response_lengths=data.response_lengths,
        loss_mask=loss_mask, advantages=to_tokens(adv.float(), data.response_lengths), group_ids=data.group_ids.clone(),
        rollout_log_probs=data.rollout_log_probs,
    ).validate()


@dataclass
class RankPlan:
    batch: StepBatch
    step_bounds: List[Tuple[int, int]]
    step_num_groups: List[int]


def plan_global_batch_steps(batch: StepBatch, *, global_batch_size: int, dp_size: int) -> List[RankPlan]:
    """One ``RankPlan`` per DP rank; every rank has the same number of steps."""
    n = batch.num_samples
    if n % global_batch_size != 0:
        fail(
            f"--global-batch-size {global_batch_size}",
            f"a rollout of --rollout-batch-size x --n-samples-per-prompt = {n} samples must split into whole steps",
            f"use a --global-batch-size that divides {n}",
        )
    per_rank_idx: List[List[torch.Tensor]] = [[] for _ in range(dp_size)]
    per_rank_gid: List[List[torch.Tensor]] = [[] for _ in range(dp_size)]
    num_groups: List[int] = []
    for start in range(0, n, global_batch_size):  # loop over steps, not samples
        idx = torch.arange(start, start + global_batch_size)
        gid = batch.group_ids[idx]
        first = int(gid.min())
        num_groups.append(int(gid.max()) - first + 1)
        for r, part in enumerate(split_samples_for_dp(global_batch_size, dp_size)):
            per_rank_idx[r].append(idx[part])
            per_rank_gid[r].append(gid[part] - first)  # step-local ids, shared across ranks
    plans = []
    for r in range(dp_size):
        sizes = [t.numel() for t in per_rank_idx[r]]
        rank_batch = batch.select(torch.cat(per_rank_idx[r]))
        rank_batch.group_ids = torch.cat(per_rank_gid[r])
        ends = torch.cumsum(torch.tensor(sizes), 0).tolist()
        bounds = [(e - s, e) for s, e in zip(sizes, ends)]
        plans.append(RankPlan(rank_batch, bounds, num_groups))
    return plans


def split_rollout_for_dp(batch: StepBatch, dp_size: int) -> List[StepBatch]:
    """--docs-per-step: each DP rank's contiguous share of the whole rollout."""
    return [batch.select(idx) for idx in split_samples_for_dp(batch.num_samples, dp_size)]
