"""One step through the loss core in one process (``rl_plugin.loss.step``): ``prepare_step`` ->
``micro_batch`` -> ``loss`` -> ``finish``. On policy (log-probs = old) PPO's per-token loss is -A,
so J and its gradient have closed forms per aggregation mode; any micro-batch split sums to them;
the reported loss is J; a micro-batch fed the wrong number of rows is refused.
(Every DP x CP layout against the reference: ``tests/fast/parity/test_loss_layouts.py``.)"""

from __future__ import annotations

import pytest
import torch

from rl_plugin.loss import LossConfig, StepBatch, prepare_step
from rl_plugin.parallel import ParallelState
from tests.support.tolerance import FP64, tensor_within, within

D = torch.float64
RESP = torch.tensor([3, 1, 2])
MASK = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0], dtype=D)
ADV = torch.tensor([1.0, 1.0, 1.0, -2.0, 0.5, 0.5], dtype=D)
LOGP = torch.tensor([-0.5, -1.0, -1.5, -0.25, -2.0, -0.75], dtype=D)


def _batch():
    return StepBatch(
        tokens=torch.arange(9),
        total_lengths=RESP + 1,
        response_lengths=RESP,
        loss_mask=MASK,
        advantages=ADV,
        group_ids=torch.tensor([0, 0, 1]),
        old_log_probs=LOGP.clone(),
    )


def _want(mode):
    """(J, dJ/dlogp) on policy: l_t = -A_t, dl_t/dlogp_t = -A_t."""
    per_sample = torch.tensor([2.0, 1.0, 2.0], dtype=D)  # M_i
    sid = torch.repeat_interleave(torch.arange(3), RESP)
    if mode == "token_mean":
        w = MASK / MASK.sum()
    else:  # sample_mean: each sample's token mean, averaged over the 3 samples
        w = MASK / per_sample[sid] / 3
    return float((-ADV * w).sum()), -ADV * w


@pytest.mark.parametrize("mode", ["token_mean", "sample_mean"])
@pytest.mark.parametrize("split", [[[0, 1, 2]], [[0], [1, 2]], [[2], [0], [1]]], ids=["one", "two", "three"])
def test_micro_batches_sum_to_j_and_its_gradient(mode, split):
    cfg = LossConfig(loss_aggregation=mode, pg_metrics="basic")
    ctx = prepare_step(_batch(), cfg, ParallelState.single(), num_groups=2)
    leaf = LOGP.clone().requires_grad_(True)
    total = torch.zeros((), dtype=D)
    for idx in split:
        mb = ctx.micro_batch(idx)
        contrib = ctx.loss(leaf[mb.local_index], None, mb).objective
        contrib.backward()
        total = total + contrib.detach()
    j, grad = _want(mode)
    assert within(total, j, rtol=FP64, scale=float(ADV.abs().max()))
    assert tensor_within(leaf.grad, grad, rtol=FP64)
    report = ctx.finish()
    assert within(report["loss"], j, rtol=FP64, scale=float(ADV.abs().max()))
    assert (report["samples"], report["tokens"], report["groups"]) == (3.0, 5.0, 2.0)
    assert report["ratio_mean"] == 1.0 and report["pg_clipfrac"] == 0.0  # on policy
    assert report["advantage_max"] == 1.0 and report["advantage_min"] == -2.0  # the masked token not counted


def test_a_micro_batch_slices_the_step_tensors():
    ctx = prepare_step(_batch(), LossConfig(loss_aggregation="token_mean"), ParallelState.single(), num_groups=2)
    mb = ctx.micro_batch([2, 0])
    assert mb.local_index.tolist() == [4, 5, 0, 1, 2] and mb.sample_index.tolist() == [2, 0]
    assert mb.advantages.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0] and mb.loss_mask.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert mb.sample_token_counts.tolist() == [2.0, 2.0] and mb.pg_weights.tolist() == [0.2, 0.2, 0.2, 0.2, 0.0]
    with pytest.raises(ValueError, match="log_probs has 4 rows, the micro-batch has 5 local response tokens"):
        ctx.loss(torch.zeros(4, dtype=D), None, mb)
