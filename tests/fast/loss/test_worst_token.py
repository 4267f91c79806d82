"""The step's worst token for ``--ci-test`` (``rl_plugin.loss.worst_token``): the vectorised pass
against a per-token Python reference on random batches (empty and all-masked responses included),
the first of tied tokens, a step with no trained token, the step report's entries (and none
without the flag: the default path's report is unchanged), and the largest over two DP ranks on a
real gloo world naming the rollout's sample."""

from __future__ import annotations

import math

import pytest
import torch

from rl_plugin.loss import LossConfig, StepBatch
from rl_plugin.loss.step import prepare_step
from rl_plugin.loss.worst_token import ACTOR_REF_KEYS, KEYS, reduce_worst, worst_token
from rl_plugin.parallel import ParallelState


def _naive(old, rollout, mask, lengths, sample_index):
    """Token by token: the first trained token with the largest |old - rollout|."""
    best, t = None, 0
    for i, n in enumerate(lengths.tolist()):
        for j in range(n):
            d = abs(float(old[t]) - float(rollout[t]))
            if mask[t] > 0 and (best is None or d > best[0]):
                best = (d, int(sample_index[i]), j, float(old[t]), float(rollout[t]))
            t += 1
    return best


def _random(seed: int):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 9, (1,), generator=g))
    lengths = torch.randint(0, 7, (n,), generator=g)
    r = int(lengths.sum())
    old = -torch.rand(r, generator=g) * 5
    rollout = old + 1e-3 * torch.randn(r, generator=g)
    mask = (torch.rand(r, generator=g) > 0.3).float()
    sample_index = torch.randperm(40, generator=g)[:n]
    return old, rollout, mask, lengths, sample_index


@pytest.mark.parametrize("seed", range(25))
def test_matches_the_per_token_reference(seed):
    old, rollout, mask, lengths, sample_index = _random(seed)
    got = worst_token(old, rollout, mask, lengths, sample_index)
    want = _naive(old, rollout, mask, lengths, sample_index)
    if want is None:
        assert got[0] == -math.inf and reduce_worst(got, None) == dict.fromkeys(KEYS)
    else:
        assert got.tolist() == [want[0], float(want[1]), float(want[2]), want[3], want[4]]


def test_ties_name_the_first_token_and_the_step_local_index_without_sample_index():
    old = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    rollout = torch.tensor([-1.0, -2.5, -3.0, -4.5])  # |d| 0.5 at token 1 (sample 0) and token 3 (sample 2)
    got = worst_token(old, rollout, torch.ones(4), torch.tensor([2, 0, 2]))
    assert got.tolist() == [0.5, 0.0, 1.0, -2.0, -2.5]


def _step(cfg: LossConfig) -> StepBatch:
    lengths = torch.tensor([3, 2])
    return StepBatch(
        tokens=torch.arange(9),
        total_lengths=torch.tensor([5, 4]),
        response_lengths=lengths,
        loss_mask=torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0]),
        advantages=torch.ones(5),
        group_ids=torch.tensor([0, 0]),
        old_log_probs=torch.tensor([-1.0, -2.0, -3.0, -0.5, -0.25]),
        rollout_log_probs=torch.tensor([-1.0, -2.0, -3.0, -0.75, -9.0]),  # the masked token differs most
        sample_index=torch.tensor([6, 11]),
    )


def test_the_step_reports_its_worst_token_only_when_asked():
    out = prepare_step(_step(LossConfig()), LossConfig(report_worst_token=True), ParallelState.single()).finish()
    assert {k: out[k] for k in KEYS} == dict(zip(KEYS, [11.0, 0.0, -0.5, -0.75]))
    assert out["mismatch/abs_diff_max"] == 0.25
    default = prepare_step(_step(LossConfig()), LossConfig(), ParallelState.single()).finish()
    assert not set(KEYS) & set(default)


def test_the_step_reports_its_worst_actor_ref_token_when_asked_and_given_a_reference():
    batch = _step(LossConfig())
    batch.ref_log_probs = torch.tensor([-1.0, -2.0, -3.0625, -0.5, -5.0])  # the masked token differs most
    cfg = LossConfig(report_actor_ref=True)
    out = prepare_step(batch, cfg, ParallelState.single()).finish()
    assert {k: out[k] for k in ACTOR_REF_KEYS} == dict(zip(ACTOR_REF_KEYS, [6.0, 2.0, -3.0, -3.0625]))
    assert not set(KEYS) & set(out)  # the |old - rollout| token only with report_worst_token
    no_ref = prepare_step(_step(LossConfig()), cfg, ParallelState.single()).finish()
    assert not set(ACTOR_REF_KEYS) & set(no_ref)  # no reference model: nothing to compare
    batch = _step(LossConfig())
    batch.ref_log_probs = batch.old_log_probs.clone()
    same = prepare_step(batch, cfg, ParallelState.single()).finish()
    assert [same[k] for k in ACTOR_REF_KEYS] == [6.0, 0.0, -1.0, -1.0]  # equal: the first trained token


def _two_ranks(rank, world):
    ps = ParallelState.from_world()
    # rank 1 holds the rollout's samples 4 and 5; its second sample's token 1 is the worst (|d| 0.125)
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0]][rank])
    rollout = torch.tensor([[-1.0625, -2.0, -3.0], [-1.0, -2.125, -3.0]][rank])
    local = worst_token(old, rollout, torch.ones(3), torch.tensor([1, 2]), torch.tensor([[0, 1], [4, 5]][rank]))
    return reduce_worst(local, ps.dp_cp_group)


def test_the_largest_over_two_dp_ranks_names_the_rollout_sample(run_world):
    out = run_world(_two_ranks, 2)
    want = dict(zip(KEYS, [5.0, 0.0, -2.0, -2.125]))
    assert out[0] == want and out[1] == want
