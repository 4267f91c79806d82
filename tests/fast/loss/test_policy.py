"""Policy losses (``rl_plugin.loss.policy``) and KL estimators against their formulas (the advantage
estimators: ``test_advantages.py``)."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.loss import gspo_loss, kl_estimate, ppo_clip_loss, to_tokens
from rl_plugin.loss.policy import POLICY_LOSSES
from tests.support import reference as ref
from tests.support.tolerance import FP64, FP64_ELEMENTWISE, tensor_within


def _tokens(n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, generator=g, dtype=torch.float64) * 2
    old = logp + 0.4 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return logp, old, adv


def test_ppo_clip_matches_formula_with_clip_higher_and_dual_clip():
    logp, old, adv = _tokens()
    loss, clipped = ppo_clip_loss(logp, old, adv, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0)
    want = ref.ppo_tokens(logp, old, adv, 0.2, 0.28, 3.0)
    assert tensor_within(loss, want, rtol=FP64_ELEMENTWISE)  # elementwise: exp, clamp, products
    ratio = torch.exp(logp - old)
    outside = (ratio < 0.8) | (ratio > 1.28)
    assert clipped.sum() > 0 and bool((clipped <= outside.double() + (adv < 0).double()).all())


def test_ppo_ratio_one_on_policy_gives_minus_advantage():
    logp, _, adv = _tokens()
    loss, clipped = ppo_clip_loss(logp, logp, adv, eps_clip=0.2)
    assert torch.equal(loss, -adv) and float(clipped.sum()) == 0  # ratio exp(0) = 1 exactly


def test_gspo_sequence_ratio_and_gradient():
    lengths = [3, 0, 4, 2]
    logp, old, _ = _tokens(9, seed=1)
    adv = to_tokens(torch.tensor([1.0, -2.0, 0.5, -1.0], dtype=torch.float64), torch.tensor(lengths))
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 0, 0], dtype=torch.float64)
    leaf = logp.clone().requires_grad_(True)
    loss, _ = gspo_loss(leaf, old, adv, mask, lengths, eps_clip=0.2, eps_clip_high=0.3)
    want = ref.gspo_tokens(logp, old, adv, mask, lengths, 0.2, 0.3)
    assert tensor_within(loss.detach(), want, rtol=FP64)  # a masked mean per sample, then exp
    # every token of a sample carries the same sequence loss
    assert loss[0] == loss[1] == loss[2] and loss[3] == loss[6]
    # all-masked sample: M = 0, ratio exp(0) = 1, loss -A, no NaN
    assert float(loss[7].detach()) == 1.0
    loss.sum().backward()
    assert torch.isfinite(leaf.grad).all()


def test_policy_losses_registered_by_name():
    assert {"ppo_clip", "gspo"} <= set(POLICY_LOSSES)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators(kind):
    logp, refp, _ = _tokens()
    d = logp - refp
    want = {"k1": d, "k2": 0.5 * d * d, "k3": torch.exp(-d) - 1 + d, "low_var_kl": ref.low_var_kl(logp, refp)}[kind]
    # k3 = exp(-d) - 1 + d cancels terms of magnitude 1 + |d|: compare against that, not the value
    assert tensor_within(kl_estimate(logp, refp, kind), want, rtol=FP64_ELEMENTWISE, scale=1.0 + float(d.abs().max()))
    assert float(kl_estimate(logp, logp, kind).abs().max()) == 0.0
    with pytest.raises(ValueError, match="--kl-loss-type"):
        kl_estimate(logp, refp, "k4")


def test_gspo_padding_tokens_never_join_a_real_sample():
    """Packed layouts may carry padding tokens (sample id outside [0, S)): they must not change any
    sample's sequence ratio and must carry zero loss and zero gradient."""
    lengths = [3, 2]
    logp, old, _ = _tokens(5, seed=2)
    adv = to_tokens(torch.tensor([1.0, -1.0], dtype=torch.float64), torch.tensor(lengths))
    mask = torch.ones(5, dtype=torch.float64)
    clean, _ = gspo_loss(logp, old, adv, mask, lengths, eps_clip=0.2)
    pad_lp = torch.cat([logp, torch.tensor([5.0, -9.0], dtype=torch.float64)]).requires_grad_(True)
    pad_old = torch.cat([old, torch.zeros(2, dtype=torch.float64)])
    pad_adv = torch.cat([adv, torch.ones(2, dtype=torch.float64)])
    pad_mask = torch.cat([mask, torch.ones(2, dtype=torch.float64)])  # even a mask of 1 must not leak
    sids = torch.tensor([0, 0, 0, 1, 1, 2, -1])
    loss, _ = gspo_loss(pad_lp, pad_old, pad_adv, pad_mask, eps_clip=0.2, sample_ids=sids, num_samples=2)
    assert torch.equal(loss[:5].detach(), clean)
    assert float(loss[5:].detach().abs().max()) == 0.0
    loss.sum().backward()
    assert float(pad_lp.grad[5:].abs().max()) == 0.0
