"""Global per-step counts: every denominator of every aggregation mode, computed ONCE per step.

For a step with samples i (on all DP ranks), response mask m[i, t] and M_i = sum_t m[i, t]:

- ``num_samples`` N   = number of samples (empty ones, M_i = 0, included)
- ``total_tokens``    = sum_i M_i
- ``group_samples``   = samples per prompt group g, ``[G]``
- ``group_tokens``    = sum_{i in g} M_i, ``[G]``
- ``num_groups`` P    = groups with at least one sample (an all-masked group still counts)
- ``sample_tokens``   = M_i of this rank's samples, from FULL sequences (never CP chunks)

The mask may be fractional (any finite m >= 0, ``aggregation.py``): the counts are its exact
float64 sums, never rounded or clamped; consumers replace only an exactly-0 total by 1.

All DP-summed quantities travel in one all-reduce over the DP group (CP and TP ranks hold the
same samples, so they are not summed over). Group ids must be step-local, in ``[0, num_groups)``;
if ``num_groups`` is not given, one extra MAX all-reduce finds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from rl_plugin.loss.batch import StepBatch
from rl_plugin.loss.errors import BadBatchError
from rl_plugin.loss.segments import segment_sum
from rl_plugin.parallel import ParallelState, all_reduce


@dataclass(frozen=True)
class StepCounts:
    num_samples: int
    total_tokens: float
    num_groups: int
    group_samples: torch.Tensor
    group_tokens: torch.Tensor
    sample_tokens: torch.Tensor


def check_loss_mask(loss_mask: torch.Tensor, response_lengths: torch.Tensor) -> None:
    """Refuse a loss mask with a negative or non-finite entry (one reduction), naming the sample
    and the token; fractional values >= 0 are valid."""
    if not loss_mask.is_floating_point() or loss_mask.numel() == 0:
        return
    bad = ~torch.isfinite(loss_mask) | (loss_mask < 0)
    if bool(bad.any()):
        tok = int(torch.nonzero(bad).flatten()[0])
        ends = torch.cumsum(response_lengths.long().cpu(), 0)
        i = int(torch.searchsorted(ends, torch.tensor(tok), right=True))
        j = tok - (int(ends[i - 1]) if i else 0)
        raise BadBatchError(
            f"sample {i}: loss_mask[{j}] = {loss_mask[tok].item()}; a loss mask must be finite and >= 0 "
            "(fractional values weight the token; 0 drops it)"
        )


def sample_token_counts(loss_mask: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
    """M_i = sum of the mask over each sample's response (``[S]``, float64): one segmented sum,
    linear in tokens (an empty response gives 0), in the mask's float dtype (fp32 for a bool or
    integer mask: 0/1 sums are exact below 2^24 tokens per sample). A fractional mask sums to its
    true (fractional) total."""
    m = loss_mask.detach()
    m = m if m.dtype in (torch.float32, torch.float64) else m.float()
    return segment_sum(m, response_lengths).to(torch.float64)


def compute_step_counts(batch: StepBatch, ps: ParallelState, num_groups: Optional[int] = None) -> StepCounts:
    """One all-reduce over DP (two if ``num_groups`` is unknown). Raises on an empty global step."""
    return counts_of(batch.loss_mask, batch.response_lengths, batch.group_ids, ps, num_groups)


def counts_of(
    loss_mask: torch.Tensor,
    response_lengths: torch.Tensor,
    group_ids: torch.Tensor,
    ps: ParallelState,
    num_groups: Optional[int] = None,
) -> StepCounts:
    """``compute_step_counts`` from the three tensors it reads."""
    m_i = sample_token_counts(loss_mask, response_lengths)
    gid = group_ids.long()
    if num_groups is None:
        top = torch.tensor([int(gid.max()) + 1 if gid.numel() else 0], dtype=torch.long)
        num_groups = int(all_reduce(top, ps.dp_group, dist.ReduceOp.MAX).item())
    if gid.numel() and int(gid.max()) >= num_groups:
        i = int(torch.nonzero(gid >= num_groups).flatten()[0])
        raise BadBatchError(f"sample {i}: group_id {int(gid[i])} >= num_groups {num_groups} (ids are step-local)")
    packed = torch.zeros(2 + 2 * num_groups, dtype=torch.float64)
    packed[0] = response_lengths.numel()
    packed[1] = m_i.sum()
    packed[2 : 2 + num_groups].index_add_(0, gid, torch.ones_like(m_i))
    packed[2 + num_groups :].index_add_(0, gid, m_i)
    all_reduce(packed, ps.dp_group)
    n = int(packed[0].item())
    if n == 0:
        raise BadBatchError("empty step: no sample on any data-parallel rank")
    group_samples = packed[2 : 2 + num_groups]
    return StepCounts(
        num_samples=n,
        total_tokens=float(packed[1].item()),
        num_groups=int((group_samples > 0).sum().item()),
        group_samples=group_samples,
        group_tokens=packed[2 + num_groups :],
        sample_tokens=m_i,
    )
