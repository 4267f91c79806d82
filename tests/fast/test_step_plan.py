"""From a rollout to each rank's optimizer steps (``rl_plugin.step_plan``): the global-batch plan's
bounds, step-local group ids and group counts, its refusal of a batch size that does not divide
the rollout, and a ``RankPlan``'s checks, steps and pickling; the same plans of a GRPO rollout
(``loop.advantages.rollout_batch``) over DP ranks, and the ``--docs-per-step`` plan."""

from __future__ import annotations

import pickle

import pytest
import torch

from rl_plugin.errors import RLArgumentError
from rl_plugin.loop.advantages import rollout_batch
from rl_plugin.loss import StepBatch
from rl_plugin.loss.micro_batch_plan import micro_batches_by_count
from rl_plugin.step_plan import RankPlan, plan_docs_steps, plan_global_batch_steps, split_rollout_for_dp
from tests.support.rollouts import random_rollout


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


def test_global_batch_steps_split_over_dp_with_step_local_groups():
    b = rollout_batch(random_rollout(num_groups=3, n=4), "grpo")  # 12 samples
    plans = plan_global_batch_steps(b, global_batch_size=6, dp_size=2)  # 2 steps, 3 + 3 per rank
    assert [p.step_bounds for p in plans] == [[(0, 3), (3, 6)], [(0, 3), (3, 6)]]
    assert plans[0].step_num_groups == [2, 2]  # step 0: groups 0,1; step 1: groups 1,2
    # rank 0 holds samples 0-2 and 6-8, rank 1 3-5 and 9-11; group ids renumbered per step
    assert plans[0].batch.group_ids.tolist() == [0, 0, 0, 0, 0, 1] and plans[1].batch.group_ids.tolist() == [
        0,
        1,
        1,
        1,
        1,
        1,
    ]
    assert torch.equal(plans[1].batch.tokens, b.select(torch.tensor([3, 4, 5, 9, 10, 11])).tokens)
    assert sum(p.batch.num_samples for p in plans) == 12


def test_one_dp_rank_plans_the_whole_rollout_without_a_gather():
    """DP = 1: the rank's batch is the rollout's (the steps in order cover it), only the group ids
    renumbered per step; the same tensors the select path gives."""
    b = rollout_batch(random_rollout(num_groups=3, n=4), "grpo")  # 12 samples
    (plan,) = plan_global_batch_steps(b, global_batch_size=6, dp_size=1)  # 2 steps: groups 0-1 and 1-2
    ref = b.select(torch.arange(12))
    for name in ("tokens", "total_lengths", "response_lengths", "loss_mask", "advantages", "rollout_log_probs"):
        got, want = getattr(plan.batch, name), getattr(ref, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert plan.batch.group_ids.tolist() == [0] * 4 + [1] * 2 + [0] * 2 + [1] * 4
    assert plan.step_bounds == [(0, 6), (6, 12)] and plan.step_num_groups == [2, 2]
    assert b.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4  # the rollout's batch is left as it was
    (whole,) = plan_global_batch_steps(b, global_batch_size=12, dp_size=1)  # one step: the whole batch
    ((step, num_groups, micro),) = list(whole.steps())
    assert step is not whole.batch and num_groups == 3 and micro is None
    assert all(getattr(step, f) is getattr(whole.batch, f) for f in ("tokens", "advantages", "rollout_log_probs"))
    step.old_log_probs = torch.zeros(int(step.response_lengths.sum()))  # set on the step only
    assert whole.batch.old_log_probs is None


def test_global_batch_must_divide_the_rollout():
    b = rollout_batch(random_rollout(num_groups=3, n=4), "grpo")
    with pytest.raises(
        RLArgumentError,
        match=r"--global-batch-size 5: a rollout of --rollout-batch-size x --n-samples-per-prompt = 12 samples",
    ):
        plan_global_batch_steps(b, global_batch_size=5, dp_size=1)


def test_rank_plan_steps_are_slices_of_the_batch_with_their_micro_batches():
    b = rollout_batch(random_rollout(num_groups=3, n=4), "grpo")  # 12 samples
    plans = plan_global_batch_steps(b, global_batch_size=6, dp_size=2)
    steps = list(plans[1].steps())
    assert [(s.num_samples, g, m) for s, g, m in steps] == [(3, 2, None), (3, 2, None)]  # micro-batches: the step's own
    assert torch.equal(steps[1][0].tokens, b.select(torch.tensor([9, 10, 11])).tokens)
    plans[1].batch.old_log_probs = torch.zeros(int(plans[1].batch.response_lengths.sum()))  # set after planning...
    assert all(s.old_log_probs is not None for s, _, _ in plans[1].steps())  # ...travels with each step
    with pytest.raises(ValueError, match="RankPlan: 2 step bounds, 1 group counts and no micro-batch lists"):
        RankPlan(b, [(0, 6), (6, 12)], [3])


def test_docs_per_step_plan_on_one_rank():
    """Micro-batches of 2 samples, steps of >= 5 documents: 3 micro-batches per step, the last
    step keeps the short tail; micro-batch indices are relative to the step's start."""
    b = rollout_batch(random_rollout(num_groups=3, n=4), "grpo")  # 12 samples
    plan = plan_docs_steps(b, micro_batches_by_count(12, 2), num_groups=3, docs_per_step=5)
    assert plan.step_bounds == [(0, 6), (6, 12)] and plan.step_num_groups == [3, 3]
    assert [[m.tolist() for m in step] for step in plan.step_micro_batches] == [[[0, 1], [2, 3], [4, 5]]] * 2
    plan = plan_docs_steps(b, micro_batches_by_count(12, 3), num_groups=3, docs_per_step=8)
    assert plan.step_bounds == [(0, 9), (9, 12)]
    assert [[m.tolist() for m in step] for step in plan.step_micro_batches] == [
        [[0, 1, 2], [3, 4, 5], [6, 7, 8]],
        [[0, 1, 2]],
    ]


def test_docs_per_step_split_is_contiguous():
    b = rollout_batch(random_rollout(num_groups=2, n=3), "grpo")
    parts = split_rollout_for_dp(b, 4)
    assert [p.num_samples for p in parts] == [2, 2, 1, 1]
    assert torch.equal(torch.cat([p.tokens for p in parts]), b.tokens)
