"""From a rollout's samples to each training rank's plan of optimizer steps (``RankPlan``).

The loop computes advantages ONCE per rollout over whole prompt groups (``loop.advantages``), then
the rollout is cut into optimizer steps here, in one of two ways; both end in one ``RankPlan``
per rank, which ``TrainActor.train_rollout`` runs (this module sits below the loop and the Ray
actors and above the loss core, whose micro-batch planner, ``loss.micro_batch_plan``, it uses
through the package API ``rl_plugin.loss``):

- ``--global-batch-size B`` (default: the whole rollout; ``plan_global_batch_steps``, on the
  driver): step k is samples ``[kB, (k+1)B)``; each step's samples are split over DP ranks
  with ``loss.micro_batch_plan.split_samples_for_dp`` and its group ids renumbered step-locally
  (a group may straddle ranks; the loss core's counts are global). The number of samples per rollout must be
  a multiple of B. Micro-batches are left to the step (``micro_batches`` None).
- ``--docs-per-step`` (``plan_docs_steps``, in each training rank, collective over DP): each rank
  gets its ``split_samples_for_dp`` share of the whole rollout (``split_rollout_for_dp``), plans
  its micro-batches (the step runner's ``plan``) and groups micro-batch rounds into steps of
  at least that many documents over all ranks (``loss.micro_batch_plan.plan_steps_by_docs``).

Every rank's samples of all its steps are concatenated in step order, so the rank computes old
log-probs in one pass before its first step and each step is a contiguous slice.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from itertools import accumulate
from typing import Iterator, List, Optional, Tuple

import torch

from rl_plugin.errors import fail
from rl_plugin.loss import StepBatch, plan_steps_by_docs, split_samples_for_dp
from rl_plugin.tensor_pickle import pack_tensors, unpack_tensors


@dataclass
class RankPlan:
    """One training rank's share of a rollout, cut into optimizer steps.

    - ``batch``: this rank's samples of every step, concatenated in step order;
    - ``step_bounds[k] = (start, end)``: step k is ``batch`` samples ``[start, end)``;
    - ``step_num_groups[k]``: the prompt groups of step k over ALL ranks (the loss core's P);
    - ``step_micro_batches[k]``: step k's micro-batches as sample-index tensors relative to
      ``start``, or None (the whole field) to let the step plan them
      (``loss.micro_batch_plan.plan_micro_batches``).
    """

    batch: StepBatch
    step_bounds: List[Tuple[int, int]]
    step_num_groups: List[int]
    step_micro_batches: Optional[List[List[torch.Tensor]]] = None

    def __post_init__(self) -> None:
        n = len(self.step_bounds)
        if len(self.step_num_groups) != n or (
            self.step_micro_batches is not None and len(self.step_micro_batches) != n
        ):
            raise ValueError(
                f"RankPlan: {n} step bounds, {len(self.step_num_groups)} group counts and "
                f"{'no' if self.step_micro_batches is None else len(self.step_micro_batches)} micro-batch lists; "
                "each step needs one of each"
            )

    def __reduce_ex__(self, protocol):
        """Pickled (Ray's transport to a train rank) with the micro-batch index tensors in one
        buffer (``rl_plugin.tensor_pickle``) instead of torch's pickling per tensor; the batch
        pickles itself the same way (``StepBatch.__reduce_ex__``)."""
        micro = self.step_micro_batches
        packed = None if micro is None else pack_tensors([m for step in micro for m in step])
        if micro is not None and packed is None:
            return super().__reduce_ex__(protocol)
        counts = None if micro is None else [len(step) for step in micro]
        others = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "step_micro_batches"}
        return _rank_plan_from_packed, (others, counts, packed)

    def steps(self) -> Iterator[Tuple[StepBatch, int, Optional[List[torch.Tensor]]]]:
        """``(step batch, num_groups, micro_batches or None)`` of each step, in order; the step
        batch is sliced from ``batch`` when reached, so per-token fields set on ``batch`` before
        (old / reference log-probs) come with it. A step that is the whole batch (one step per
        rollout) is a shallow copy of it: the same tensors, no gather."""
        n = self.batch.num_samples
        for k, ((start, end), num_groups) in enumerate(zip(self.step_bounds, self.step_num_groups)):
            micro = None if self.step_micro_batches is None else self.step_micro_batches[k]
            sub = replace(self.batch) if (start, end) == (0, n) else self.batch.select(torch.arange(start, end))
            yield sub, num_groups, micro


def _rank_plan_from_packed(others, counts, packed) -> RankPlan:
    """Inverse of ``RankPlan.__reduce_ex__`` (``others``: every field but the micro-batches)."""
    micro = None
    if counts is not None:
        flat = iter(unpack_tensors(packed))
        micro = [[next(flat) for _ in range(c)] for c in counts]
    return RankPlan(**others, step_micro_batches=micro)


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
        gids = torch.cat(per_rank_gid[r])
        if dp_size == 1:  # the steps in order are the whole rollout: no gather (select would copy it as is)
            rank_batch = replace(batch, group_ids=gids)
        else:
            rank_batch = batch.select(torch.cat(per_rank_idx[r]))
            rank_batch.group_ids = gids
        ends = list(accumulate(sizes))
        bounds = [(e - s, e) for s, e in zip(sizes, ends)]
        plans.append(RankPlan(rank_batch, bounds, num_groups))
    return plans


def split_rollout_for_dp(batch: StepBatch, dp_size: int) -> List[StepBatch]:
    """--docs-per-step: each DP rank's contiguous share of the whole rollout."""
    return [batch.select(idx) for idx in split_samples_for_dp(batch.num_samples, dp_size)]


def plan_docs_steps(
    batch: StepBatch, micro_batches: List[torch.Tensor], *, num_groups: int, docs_per_step: int, dp_group=None
) -> RankPlan:
    """--docs-per-step: this rank's plan of its share ``batch`` (collective over ``dp_group``).

    ``micro_batches``: the rank's micro-batches, planned once by the step runner
    (``StepRunner.plan``: by count, or by token budget with the count equalised over DP); they
    are grouped into steps of >= ``docs_per_step`` documents over all ranks. Micro-batches
    are contiguous runs, so each step is a contiguous slice; a rank with no sample left in a
    step gets an empty slice and no micro-batch there. Every step counts the rollout's
    ``num_groups`` (group ids are not renumbered per step)."""
    mbs = micro_batches
    bounds: List[Tuple[int, int]] = []
    micro: List[List[torch.Tensor]] = []
    for step in plan_steps_by_docs(mbs, docs_per_step, dp_group=dp_group):
        idx = torch.cat(step) if step else torch.zeros(0, dtype=torch.long)
        start = int(idx[0]) if idx.numel() else (bounds[-1][1] if bounds else 0)
        bounds.append((start, start + idx.numel()))
        micro.append([m - start for m in step if m.numel()])
    return RankPlan(batch, bounds, [num_groups] * len(bounds), micro)
