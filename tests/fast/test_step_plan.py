"""From a rollout to each rank's optimizer steps (``rl_plugin.step_plan``): the global-batch plan's
bounds, step-local group ids and group counts, its refusal of a batch size that does not divide
the rollout, and a ``RankPlan``'s checks, steps and pickling."""

from __future__ import annotations

import pickle

import pytest
import torch

from rl_plugin.errors import RLArgumentError
from rl_plugin.loss import StepBatch
from rl_plugin.step_plan import RankPlan, plan_global_batch_steps, split_rollout_for_dp


def _rollout(n=8, group=2):
    """``n`` samples of prompt 1 + response 1 token (token i = sample i), groups of ``group``."""
    return StepBatch(
        tokens=torch.arange(2 * n),
        total_lengths=torch.full((n,), 2),
        response_lengths=torch.ones(n, dtype=torch.long),
        loss_mask=torch.ones(n),
        advantages=torch.arange(n, dtype=torch.float32),
        group_ids=torch.arange(n) // group,
    )


def test_global_batch_steps_over_two_ranks():
    plans = plan_global_batch_steps(_rollout(), global_batch_size=4, dp_size=2)
    assert len(plans) == 2
    for plan in plans:
        assert plan.step_bounds == [(0, 2), (2, 4)] and plan.step_num_groups == [2, 2]
        assert plan.step_micro_batches is None
    # step 0 = samples 0-3 (ranks: 0-1, 2-3), step 1 = samples 4-7; ids are step-local
    assert plans[0].batch.advantages.tolist() == [0, 1, 4, 5] and plans[1].batch.advantages.tolist() == [2, 3, 6, 7]
    assert plans[0].batch.group_ids.tolist() == [0, 0, 0, 0] and plans[1].batch.group_ids.tolist() == [1, 1, 1, 1]
    steps = list(plans[1].steps())
    assert [(s.advantages.tolist(), g, m) for s, g, m in steps] == [([2, 3], 2, None), ([6, 7], 2, None)]


def test_one_rank_one_step_is_the_rollout_itself():
    rollout = _rollout(6, group=3)
    (plan,) = plan_global_batch_steps(rollout, global_batch_size=6, dp_size=1)
    assert plan.step_bounds == [(0, 6)] and plan.step_num_groups == [2]
    ((step, _, _),) = plan.steps()
    assert step.tokens is rollout.tokens  # no gather: the same tensors


def test_a_batch_size_that_does_not_divide_the_rollout_is_refused():
    with pytest.raises(
        RLArgumentError, match=r"--global-batch-size 3: .* = 8 samples .*Fix: use a --global-batch-size that divides 8"
    ):
        plan_global_batch_steps(_rollout(), global_batch_size=3, dp_size=1)


def test_split_rollout_for_dp_gives_contiguous_shares():
    shares = split_rollout_for_dp(_rollout(5), 2)
    assert [s.advantages.tolist() for s in shares] == [[0, 1, 2], [3, 4]]


def test_rank_plan_checks_its_lists_and_pickles_its_micro_batches():
    with pytest.raises(ValueError, match="2 step bounds, 1 group counts and no micro-batch lists"):
        RankPlan(_rollout(), [(0, 4), (4, 8)], [2])
    micro = [[torch.tensor([0, 1]), torch.tensor([2, 3])], [torch.tensor([0]), torch.tensor([1, 2, 3])]]
    plan = RankPlan(_rollout(), [(0, 4), (4, 8)], [2, 2], micro)
    back = pickle.loads(pickle.dumps(plan))
    assert back.step_bounds == plan.step_bounds and back.step_num_groups == [2, 2]
    assert [[m.tolist() for m in step] for step in back.step_micro_batches] == [[[0, 1], [2, 3]], [[0], [1, 2, 3]]]
    assert torch.equal(back.batch.tokens, plan.batch.tokens)
