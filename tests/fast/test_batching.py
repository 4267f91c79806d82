"""Batching shared by both backends: DP split, micro-batches by count / token budget (count
equalised over DP), docs-per-step planning over real gloo ranks."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.batching import micro_batches_by_count, micro_batches_by_tokens, plan_micro_batches, plan_steps_by_docs, split_samples_for_dp
from rl_plugin.loss import StepBatch
from rl_plugin.parallel import ParallelState
from tests.fast.harness import run_world


def _cat(parts):
    return torch.cat(parts).tolist() if parts else []


def test_split_samples_for_dp_is_contiguous_and_balanced():
    parts = split_samples_for_dp(10, 4)
    assert [p.numel() for p in parts] == [3, 3, 2, 2] and _cat(parts) == list(range(10))
    assert [p.numel() for p in split_samples_for_dp(2, 4)] == [1, 1, 0, 0]


def test_micro_batches_by_count_and_tokens():
    assert [p.tolist() for p in micro_batches_by_count(5, 2)] == [[0, 1], [2, 3], [4]]
    plan = micro_batches_by_tokens(torch.tensor([5, 5, 3, 9, 1, 1]), 10)
    assert [p.tolist() for p in plan] == [[0, 1], [2], [3, 4], [5]]
    with pytest.raises(ValueError, match="sample 3 has 11 tokens, more than --max-tokens-per-gpu 10"):
        micro_batches_by_tokens(torch.tensor([1, 2, 3, 11]), 10)
    with pytest.raises(ValueError, match="--micro-batch-size"):
        micro_batches_by_count(3, 0)


def _batch(lengths):
    total = torch.tensor(lengths)
    resp = torch.ones_like(total)
    return StepBatch(tokens=torch.zeros(int(total.sum()), dtype=torch.long), total_lengths=total, response_lengths=resp,
                     loss_mask=torch.ones(len(lengths)), advantages=torch.zeros(len(lengths)), group_ids=torch.zeros(len(lengths), dtype=torch.long))


def _plan_worker(rank, world):
    ps = ParallelState.from_world(tp=1, cp=1, dp=world)
    lengths = [[4, 4, 4, 4, 4, 4], [9, 1, 1]][rank]  # rank 0 needs 3 micro-batches of 10, rank 1 needs 2
    plan = plan_micro_batches(_batch(lengths), micro_batch_size=1, max_tokens_per_gpu=10, dp_group=ps.dp_group)
    steps = plan_steps_by_docs(plan, 5, ps.dp_group)
    return [p.tolist() for p in plan], [[mb.tolist() for mb in step] for step in steps]


def test_token_budget_count_equalised_over_dp_and_docs_per_step():
    (plan0, steps0), (plan1, steps1) = run_world(_plan_worker, 2)
    assert len(plan0) == len(plan1) == 3  # rank 1 split further to match rank 0
    assert plan1 == [[0], [1], [2]]
    assert sum(len(p) for p in plan0) == 6
    # rounds carry 2+1 docs each globally; target 5 -> a step closes after round 2 (6 docs)
    assert len(steps0) == len(steps1) == 2
    assert [len(s) for s in steps0] == [2, 1]


def test_docs_per_step_single_rank_keeps_short_tail():
    steps = plan_steps_by_docs(micro_batches_by_count(7, 2), 3)
    assert [[mb.tolist() for mb in s] for s in steps] == [[[0, 1], [2, 3]], [[4, 5], [6]]]
