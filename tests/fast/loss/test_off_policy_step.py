"""The step's off-policy terms (``rl_plugin.loss.off_policy_step``): the mismatch and TIS sums one
rank adds (CP rank 0 only; the max on every rank) against hand values, the TIS weights of a
micro-batch from the forward's log-probs equal the whole-step ones, and the refusals of
``old_from_forward`` naming why."""

from __future__ import annotations

import math

import pytest
import torch

from rl_plugin.loss import LossConfig, StepBatch
from rl_plugin.loss.errors import BadBatchError
from rl_plugin.loss.metrics import MetricAccumulator
from rl_plugin.loss.off_policy_step import (
    check_old_from_forward,
    forward_tis_weights,
    off_policy_weights,
    old_from_forward_unsupported,
)
from rl_plugin.parallel import ParallelState
from tests.support.tolerance import FP64, tensor_within, within

D = torch.float64
OLD = torch.tensor([-1.0, -2.0, -0.5, -0.25], dtype=D)
ROLLOUT = torch.tensor([-1.5, -2.0, -1.5, -0.25], dtype=D)  # d = old - rollout = 0.5, 0, 1, 0
MASK = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=D)
RESP = torch.tensor([2, 2])
W_SM = torch.tensor([0.25, 0.25, 0.5, 0.0], dtype=D)  # sample 0: 2 tokens; sample 1: 1 trained token


def _reduced(acc):
    return acc.reduce(ParallelState.single())


def test_token_tis_weights_and_mismatch_sums():
    cfg = LossConfig(use_tis=True, tis_level="token", tis_mode="truncate", tis_clip=2.0, tis_clip_low=0.0)
    acc = MetricAccumulator()
    w, measured = off_policy_weights(OLD, ROLLOUT, MASK, RESP, W_SM, cfg, acc, cp_rank=0)
    assert measured
    assert tensor_within(w[:3], torch.tensor([math.exp(0.5), 1.0, 2.0], dtype=D), rtol=FP64)  # exp(1) clipped to 2
    out = _reduced(acc)
    assert within(out["mismatch/abs_diff_mean"], 0.25 * 0.5 + 0.5 * 1.0, rtol=FP64)
    k3 = lambda d: math.expm1(d) - d  # noqa: E731
    assert within(out["mismatch/k3_kl"], 0.25 * k3(0.5) + 0.5 * k3(1.0), rtol=FP64)
    assert within(out["tis/weight_mean"], 0.25 * math.exp(0.5) + 0.25 + 0.5 * 2.0, rtol=FP64)
    assert out["tis/clipped_frac"] == 0.5 and out["mismatch/abs_diff_max"] == 1.0


def test_other_cp_ranks_add_only_the_max():
    acc = MetricAccumulator()
    w, measured = off_policy_weights(OLD, ROLLOUT, MASK, RESP, W_SM, LossConfig(), acc, cp_rank=1)
    assert w is None and measured  # no --use-tis: no weights, the mismatch is still measured
    assert _reduced(acc) == {"mismatch/abs_diff_max": 1.0}
    assert off_policy_weights(OLD, None, MASK, RESP, W_SM, LossConfig(), MetricAccumulator(), 0) == (None, False)


def test_use_tis_without_both_log_probs_names_the_missing_one():
    cfg = LossConfig(use_tis=True)
    with pytest.raises(BadBatchError, match=r"no rollout_log_probs \(the engine's\)"):
        off_policy_weights(OLD, None, MASK, RESP, W_SM, cfg, MetricAccumulator(), 0)
    with pytest.raises(BadBatchError, match=r"no old_log_probs \(the trainer's\)"):
        off_policy_weights(None, ROLLOUT, MASK, RESP, W_SM, cfg, MetricAccumulator(), 0)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_forward_weights_of_each_micro_batch_are_the_whole_steps(level):
    cfg = LossConfig(use_tis=True, tis_level=level, tis_mode="truncate", tis_clip=2.0, tis_clip_low=0.5)
    whole, _ = off_policy_weights(OLD, ROLLOUT, MASK, RESP, W_SM, cfg, MetricAccumulator(), 0)
    parts = [
        forward_tis_weights(OLD[a:b], ROLLOUT[a:b], MASK[a:b], RESP[i : i + 1], cfg)
        for i, (a, b) in enumerate([(0, 2), (2, 4)])
    ]
    assert torch.equal(torch.cat(parts), whole)


def _batch(**over):
    fields = dict(
        tokens=torch.zeros(6, dtype=torch.long),
        total_lengths=torch.tensor([3, 3]),
        response_lengths=RESP,
        loss_mask=MASK,
        advantages=torch.zeros(4, dtype=D),
        group_ids=torch.tensor([0, 0]),
        rollout_log_probs=ROLLOUT,
    )
    fields.update(over)
    return StepBatch(**fields)


def test_old_from_forward_rules():
    assert check_old_from_forward(_batch(), LossConfig(use_tis=True), 1) is True
    assert check_old_from_forward(_batch(rollout_log_probs=None), LossConfig(), 2) is False
    with pytest.raises(ValueError, match="already carries old_log_probs"):
        check_old_from_forward(_batch(old_log_probs=OLD), LossConfig(), 1)
    with pytest.raises(BadBatchError, match="--use-tis needs the rollout log-probs"):
        check_old_from_forward(_batch(rollout_log_probs=None), LossConfig(use_tis=True), 1)
    with pytest.raises(
        ValueError, match="old_from_forward: context parallelism: .*; compute old log-probs in a separate pass"
    ):
        check_old_from_forward(_batch(), LossConfig(), 2)
    assert "--use-opd shifts the advantages" in old_from_forward_unsupported(LossConfig(use_opd=True), 1, False)
    custom = LossConfig(use_tis=True, custom_tis_function=lambda *a, **k: None)
    assert old_from_forward_unsupported(custom, 1, True).startswith("--custom-tis-function-path")
