"""A masked segment in the middle of a response (a tool turn a custom generate hook appended,
issue 27) is out of every loss term and every count: for every --loss-aggregation mode, GSPO's
sequence ratio and the sequence / geometric TIS levels, the step with the segment masked gives the
same J (and the same gradient on the model's tokens) as the step with the segment cut out of the
responses, whatever the loss at the masked tokens (inf included), and its gradient there is 0."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.cp import segment_ids
from rl_plugin.loss import AGGREGATION_MODES, aggregate, gspo_loss, tis_weights

LENGTHS = torch.tensor([7, 5, 9, 6])
GROUPS = torch.tensor([0, 0, 1, 1])
TOOL = (2, 5)  # response positions [2, 5) of every sample: the tool turn


def _tool_mask():
    sid = segment_ids(LENGTHS)
    pos = torch.arange(int(LENGTHS.sum())) - (torch.cumsum(LENGTHS, 0) - LENGTHS)[sid]
    return ((pos < TOOL[0]) | (pos >= TOOL[1])).double()


def _cut(x, mask):
    return x[mask > 0]


CUT_LENGTHS = LENGTHS - (TOOL[1] - TOOL[0])


@pytest.mark.parametrize("mode", [m for m in AGGREGATION_MODES])
def test_aggregation_ignores_the_masked_segment(mode):
    g = torch.Generator().manual_seed(0)
    mask = _tool_mask()
    x = torch.randn(mask.numel(), dtype=torch.float64, generator=g, requires_grad=True)
    x_bad = torch.where(mask > 0, x, torch.full_like(x, float("inf")))  # the loss there cannot leak
    div = 4.0 if mode == "constant" else None
    j = aggregate(x_bad, mask, LENGTHS, mode, group_ids=GROUPS, divisor=div)
    (grad,) = torch.autograd.grad(j, x)
    x_cut = _cut(x.detach(), mask).requires_grad_(True)
    j_cut = aggregate(x_cut, torch.ones_like(x_cut), CUT_LENGTHS, mode, group_ids=GROUPS, divisor=div)
    (grad_cut,) = torch.autograd.grad(j_cut, x_cut)
    assert float(j.detach()) == pytest.approx(float(j_cut.detach()), rel=1e-14, abs=1e-15)
    assert torch.equal(grad[mask == 0], torch.zeros_like(grad[mask == 0]))
    assert torch.allclose(_cut(grad, mask), grad_cut, rtol=1e-14, atol=1e-16)


def test_gspo_sequence_ratio_and_tis_levels_count_model_tokens_only():
    g = torch.Generator().manual_seed(1)
    mask = _tool_mask()
    n = mask.numel()
    old = -torch.rand(n, dtype=torch.float64, generator=g)
    logp = (old + 0.1 * torch.randn(n, dtype=torch.float64, generator=g)).requires_grad_(True)
    rollout = old + 0.2 * torch.randn(n, dtype=torch.float64, generator=g)
    adv = torch.randn(len(LENGTHS), dtype=torch.float64, generator=g).repeat_interleave(LENGTHS)
    # the masked tokens get wild values: they must not move anything
    wild = torch.where(mask > 0, torch.zeros_like(old), torch.full_like(old, 7.0))
    loss, _ = gspo_loss(logp + wild, old - wild, adv, mask, LENGTHS, eps_clip=0.2)
    keep = mask > 0
    loss_cut, _ = gspo_loss(logp[keep], old[keep], adv[keep], torch.ones(int(keep.sum())), CUT_LENGTHS, eps_clip=0.2)
    assert torch.allclose(loss[keep], loss_cut, rtol=1e-14, atol=0)
    for level in ("sequence", "geometric"):
        w, metrics = tis_weights(old - wild, rollout + wild, mask, LENGTHS, level=level, clip_high=10.0)
        w_cut, metrics_cut = tis_weights(
            old[keep], rollout[keep], torch.ones(int(keep.sum())), CUT_LENGTHS, level=level, clip_high=10.0
        )
        assert torch.allclose(w[keep], w_cut, rtol=1e-13, atol=0), level
        for k in metrics:
            assert metrics[k] == pytest.approx(metrics_cut[k], rel=1e-12), (level, k)
