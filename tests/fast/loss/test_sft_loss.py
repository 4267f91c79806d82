"""Issue 35, SFT through the loss core (``--loss-type sft_loss``): the per-token loss is the NLL
-log p(y_t), and every aggregation mode gives its definition, computed here by hand over the
assistant tokens (mask 1), with the value and the gradient the same over any micro-batch split;
the ``sft/*`` metrics (token-mean NLL whatever the mode, its exp, the trained-token count)."""

from __future__ import annotations

import math

import pytest
import torch

from rl_plugin.loss import AGGREGATION_MODES, LossConfig, StepBatch, prepare_step
from rl_plugin.parallel import ParallelState
from tests.support.tolerance import FP64, within

LENGTHS = [3, 5, 1, 4, 2]  # response tokens per conversation
MASK = [1, 0, 1, 0, 1, 1, 0, 1, 1, 1, 1, 0, 0, 1, 1]  # assistant tokens 1, user turns inside 0
GROUPS = [0, 1, 1, 2, 2]  # prompt_mean reads them (SFT gives each conversation its own)
DIVISOR = 6.0


def _hand(nll, mode):
    """The mode's definition over per-conversation sums (docs: loss/aggregation.py), as a tensor of
    ``nll`` (differentiable: its gradient is the hand gradient)."""
    m, sums, counts, start = torch.tensor(MASK, dtype=torch.float64), [], [], 0
    for n in LENGTHS:
        sums.append((nll[start : start + n] * m[start : start + n]).sum())
        counts.append(float(m[start : start + n].sum()))
        start += n
    if mode == "token_mean":
        return sum(sums) / sum(counts)
    if mode == "sample_mean":
        return sum(s / c for s, c in zip(sums, counts)) / len(sums)
    if mode == "constant":
        return sum(sums) / (len(sums) * DIVISOR)
    groups = sorted(set(GROUPS))
    per_group = [
        sum(s for s, g in zip(sums, GROUPS) if g == k) / sum(c for c, g in zip(counts, GROUPS) if g == k)
        for k in groups
    ]
    return sum(per_group) / len(groups)


def _batch():
    n = sum(LENGTHS)
    prompt = 2
    total = torch.tensor([r + prompt for r in LENGTHS])
    return StepBatch(
        tokens=torch.arange(int(total.sum())) % 7,
        total_lengths=total,
        response_lengths=torch.tensor(LENGTHS),
        loss_mask=torch.tensor(MASK, dtype=torch.float32),
        advantages=torch.zeros(n),
        group_ids=torch.tensor(GROUPS),
    )


def _run(mode, split):
    """J and dJ/dlogp from the loss core, micro-batches ``split`` (sample indices)."""
    g = torch.Generator().manual_seed(3)
    logp = (-torch.rand(sum(LENGTHS), generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    cfg = LossConfig(loss_type="sft_loss", is_sft=True, loss_aggregation=mode, loss_aggregation_divisor=DIVISOR)
    ctx = prepare_step(_batch(), cfg, ParallelState.single())
    total = 0.0
    for idx in split:
        mb = ctx.micro_batch(idx)
        out = ctx.loss(logp[mb.local_index], None, mb)
        out.objective.backward()
        total += float(out.objective.detach())
    return logp, total, ctx.finish()


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("split", [[[0, 1, 2, 3, 4]], [[0, 3], [1], [2, 4]]])
def test_sft_loss_is_each_modes_definition_of_the_nll(mode, split):
    logp, j, report = _run(mode, split)
    leaf = logp.detach().clone().requires_grad_(True)
    hand = _hand(-leaf, mode)
    want = float(hand.detach())
    assert within(j, want, rtol=FP64) and within(report["loss"], want, rtol=FP64)
    (grad,) = torch.autograd.grad(hand, leaf)  # the hand definition's gradient w.r.t. log p
    assert torch.allclose(logp.grad, grad, rtol=1e-12, atol=1e-15)
    masked = torch.tensor(MASK) == 0
    assert float(logp.grad[masked].abs().max()) == 0.0  # user turns inside a conversation train nothing


def test_sft_metrics_are_the_token_mean_nll_and_its_exp_whatever_the_mode():
    _, _, report = _run("sample_mean", [[0, 1, 2, 3, 4]])
    logp, _, _ = _run("token_mean", [[0, 1], [2, 3, 4]])
    token_mean = float(_hand(-logp.detach(), "token_mean"))
    assert report["sft/tokens"] == sum(MASK) == report["tokens"]
    assert within(report["sft/nll"], token_mean, rtol=FP64)
    assert within(report["sft/ppl"], math.exp(token_mean), rtol=1e-12)
    assert "ratio_mean" not in report and "advantage_mean" not in report  # RL's metrics are constants here


def test_sft_objective_takes_no_old_log_probs_and_no_advantage():
    """The NLL ignores the batch's advantages and old log-probs (SFT sends none)."""
    cfg = LossConfig(loss_type="sft_loss", is_sft=True, loss_aggregation="token_mean")
    batch = _batch()
    batch.advantages = torch.randn(batch.advantages.shape[0])
    ctx = prepare_step(batch, cfg, ParallelState.single())
    mb = ctx.micro_batch([0, 1, 2, 3, 4])
    logp = -torch.rand(sum(LENGTHS), dtype=torch.float64)
    j = float(ctx.loss(logp, None, mb).objective)
    assert within(j, float(_hand(-logp, "token_mean")), rtol=FP64)
