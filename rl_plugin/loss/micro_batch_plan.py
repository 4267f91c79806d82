"""The micro-batch planner: how a rank's samples become DP shards, micro-batches and rounds of
micro-batches per optimizer step (shared by both backends; it sits in the loss core beside its
user, the step runner, and ``step_plan`` above the core uses it through ``rl_plugin.loss``).

- ``split_samples_for_dp``: contiguous sample ranges per data-parallel rank. Prompt groups may
  straddle ranks: the loss core's counts are global, so that is harmless.
- ``micro_batches_by_count`` (``--micro-batch-size``) and ``micro_batches_by_tokens``
  (``--use-dynamic-batch-size --max-tokens-per-gpu``, order-preserving next-fit).
- ``plan_micro_batches``: the backend's choice between the two; with a token budget the number
  of micro-batches is equalised across DP ranks (one MAX all-reduce), since FSDP's collective
  passes and ``plan_steps_by_docs``' rounds pair micro-batch k of every rank. A rank below the MAX
  re-splits its samples into exactly that many runs, balanced (min-max tokens) and each within
  ``--max-tokens-per-gpu``; only a rank with fewer samples than the count gets empty micro-batches
  (at the end; both backends run them as zero-contribution passes).
- ``plan_steps_by_docs`` (``--docs-per-step``): a step ends once the global document count
  reaches the target. It is planned once, before the step, from every rank's micro-batch sizes
  (one all-gather), so the step's counts are still global and computed once.

All index tensors are int64 sample indices into the caller's (rank-local) sample order.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from rl_plugin.loss.batch import StepBatch
from rl_plugin.parallel import all_reduce


def split_samples_for_dp(num_samples: int, dp_size: int) -> List[torch.Tensor]:
    """Contiguous ranges, sizes differing by at most one (the first ranks take the extra)."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    base, extra = divmod(num_samples, dp_size)
    sizes = [base + (1 if r < extra else 0) for r in range(dp_size)]
    return list(torch.arange(num_samples).split(sizes))


def micro_batches_by_count(num_samples: int, micro_batch_size: int) -> List[torch.Tensor]:
    if micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
    return list(torch.arange(num_samples).split(micro_batch_size))


def micro_batches_by_tokens(total_lengths: torch.Tensor, max_tokens: int) -> List[torch.Tensor]:
    """Order-preserving next-fit packing: a micro-batch is closed when the next sample would push
    it past ``max_tokens``. A sample longer than the budget raises, naming the sample."""
    lengths = torch.as_tensor(total_lengths, dtype=torch.long)
    too_long = torch.nonzero(lengths > max_tokens).flatten()
    if too_long.numel():
        i = int(too_long[0])
        raise ValueError(
            f"sample {i} has {int(lengths[i])} tokens, more than --max-tokens-per-gpu {max_tokens}: "
            "raise the budget or cap --rollout-max-response-len"
        )
    bounds, used = [0], 0
    for i, n in enumerate(lengths.tolist()):  # O(S) scalar scan at planning time, once per step
        if used + n > max_tokens and i > bounds[-1]:
            bounds.append(i)
            used = 0
        used += n
    bounds.append(lengths.numel())
    return [torch.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _min_parts(lengths: List[int], cap: int) -> int:
    """Fewest contiguous runs with at most ``cap`` tokens each (next-fit is optimal for runs)."""
    parts, used = 1, 0
    for n in lengths:
        if used + n > cap and used > 0:
            parts, used = parts + 1, 0
        used += n
    return parts


def _split_into(lengths: torch.Tensor, parts: int, max_tokens: int) -> List[torch.Tensor]:
    """Split an ordered sample list into exactly ``parts`` contiguous runs, none above
    ``max_tokens``, with the largest run as small as possible; empty runs only past the last
    sample (a rank with fewer samples than ``parts``).

    The smallest feasible cap L (binary search over [max sample, max_tokens]: at most
    log2(max_tokens) next-fit scans) is the min-max balanced partition; the runs are then cut
    next-fit under L, closing a run early only when the samples left are exactly the runs left,
    so there are exactly ``parts`` runs and each is within L <= max_tokens. Any count between
    the rank's own next-fit count (<= ``parts``, since ``parts`` is the MAX over DP) and its sample
    count is reachable, so the budget always holds."""
    ln = [int(v) for v in torch.as_tensor(lengths).tolist()]
    n = len(ln)
    if n <= parts:  # one sample per run, then empty runs (the backends run those as no-ops)
        return [torch.tensor([i]) for i in range(n)] + [torch.zeros(0, dtype=torch.long)] * (parts - n)
    lo, hi = max(ln), max(int(max_tokens), max(ln))
    while lo < hi:  # smallest cap whose fewest runs fit in ``parts``
        mid = (lo + hi) // 2
        if _min_parts(ln, mid) <= parts:
            hi = mid
        else:
            lo = mid + 1
    bounds, used = [0], 0
    for i, t in enumerate(ln):
        runs_left = parts - len(bounds)  # runs still to open after the current one
        if i > bounds[-1] and (used + t > lo or n - i == runs_left):
            bounds.append(i)
            used = 0
        used += t
    bounds.append(n)
    return [torch.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def micro_batches_for_count(total_lengths: torch.Tensor, max_tokens: int, count: int) -> List[torch.Tensor]:
    """One rank's ``count`` micro-batches under the token budget (``count`` >= its own next-fit
    count, e.g. the MAX over DP): its next-fit plan when that has ``count`` runs, else the
    balanced split of ``_split_into``. Every micro-batch holds <= ``max_tokens`` tokens and none
    is empty unless the rank has fewer than ``count`` samples."""
    plan = micro_batches_by_tokens(total_lengths, max_tokens)
    if len(plan) == count:
        return plan
    if len(plan) > count:  # the caller asked for fewer runs than the budget allows
        raise ValueError(
            f"{count} micro-batches requested, but this rank needs {len(plan)} under --max-tokens-per-gpu {max_tokens}"
        )
    return _split_into(torch.as_tensor(total_lengths).long(), count, max_tokens)


def plan_micro_batches(
    batch: StepBatch,
    *,
    micro_batch_size: int,
    max_tokens_per_gpu: Optional[int] = None,
    dp_group=None,
) -> List[torch.Tensor]:
    """Micro-batches of one rank's step: by count, or by token budget (count equalised over DP,
    each micro-batch within the budget: ``micro_batches_for_count``)."""
    if max_tokens_per_gpu is None:
        return micro_batches_by_count(batch.num_samples, micro_batch_size)
    plan = micro_batches_by_tokens(batch.total_lengths, max_tokens_per_gpu)
    count = torch.tensor([len(plan)], dtype=torch.long)
    target = int(all_reduce(count, dp_group, dist.ReduceOp.MAX).item())
    if target == len(plan):
        return plan
    return _split_into(batch.total_lengths.long(), target, max_tokens_per_gpu)


def plan_steps_by_docs(
    local_micro_batches: List[torch.Tensor], docs_per_step: int, dp_group=None
) -> List[List[torch.Tensor]]:
    """Group micro-batch rounds into steps of >= ``docs_per_step`` global documents.

    Round k is micro-batch k on every DP rank. One all-gather of the per-rank micro-batch sizes
    gives the global documents per round; a step closes at the first round where its running
    total reaches the target. Ranks with fewer micro-batches contribute 0 to later rounds (so
    callers should equalise counts, as ``plan_micro_batches`` does). The last step may fall short
    of the target: it is kept, not dropped, and the caller sees its real size.
    """
    if docs_per_step < 1:
        raise ValueError(f"--docs-per-step must be >= 1, got {docs_per_step}")
    sizes = torch.tensor([mb.numel() for mb in local_micro_batches], dtype=torch.long)
    if dp_group is not None:
        n = torch.tensor([sizes.numel()], dtype=torch.long)
        world = dist.get_world_size(dp_group)
        counts = [torch.zeros_like(n) for _ in range(world)]
        dist.all_gather(counts, n, group=dp_group)
        width = int(max(int(c) for c in counts))
        padded = torch.zeros(width, dtype=torch.long)
        padded[: sizes.numel()] = sizes
        gathered = [torch.zeros_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=dp_group)
        per_round = torch.stack(gathered).sum(0)
    else:
        per_round = sizes
    steps: List[List[torch.Tensor]] = []
    current: List[torch.Tensor] = []
    total = 0
    for k, docs in enumerate(per_round.tolist()):  # loop over rounds (micro-batches), not samples
        current.append(local_micro_batches[k] if k < len(local_micro_batches) else torch.zeros(0, dtype=torch.long))
        total += docs
        if total >= docs_per_step:
            steps.append(current)
            current, total = [], 0
    if current:
        steps.append(current)
    return steps
