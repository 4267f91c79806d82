"""The step objective's terms (``rl_plugin.loss.objective``): J = J_pg + kl_coef * SampleMean(kl)
- entropy_coef * SampleMean(H) against a hand computation, a masked token's log-prob kept out of
the KL's value and gradient, the errors naming the missing input, and the custom reducer's
normalisation (global N, or tokens under per-token loss, and the CP share)."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.loss import LossConfig, StepBatch
from rl_plugin.loss.counts import StepCounts
from rl_plugin.loss.objective import custom_pg_term, kl_and_entropy_terms
from tests.support.tolerance import FP64, within

D = torch.float64


def _inputs():
    logp = torch.tensor([-0.5, -1.0, -2.0, -0.25], dtype=D, requires_grad=True)
    ref = torch.tensor([-0.75, -1.0, -1.5, -1.0], dtype=D)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=D)
    w_sm = torch.tensor([0.25, 0.25, 0.0, 0.5], dtype=D)  # sample-mean weights (zero where masked)
    ent = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=D)
    return logp, ref, mask, w_sm, ent


def test_kl_and_entropy_terms_against_the_formula():
    logp, ref, mask, w_sm, ent = _inputs()
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1", entropy_coef=0.01)
    pg = torch.tensor(0.3, dtype=D)
    objective, kl, h = kl_and_entropy_terms(pg, logp, ent, ref, mask, w_sm, cfg)
    want_kl = 0.25 * 0.25 + 0.25 * 0.0 + 0.5 * 0.75  # k1 = logp - ref, weighted by w_sm
    want_h = 0.25 * 1 + 0.25 * 2 + 0.5 * 4
    assert within(kl.detach(), want_kl, rtol=FP64) and within(h, want_h, rtol=FP64)
    assert within(objective.detach(), 0.3 + 0.1 * want_kl - 0.01 * want_h, rtol=FP64)
    objective.backward()
    assert torch.allclose(logp.grad, 0.1 * w_sm, rtol=0, atol=1e-16)  # d(k1)/dlogp = 1


def test_off_terms_are_none_and_the_objective_is_the_pg_term():
    logp, ref, mask, w_sm, ent = _inputs()
    pg = torch.tensor(0.3, dtype=D)
    objective, kl, h = kl_and_entropy_terms(pg, logp, None, None, mask, w_sm, LossConfig())
    assert objective is pg and kl is None and h is None


def test_a_masked_tokens_log_prob_cannot_poison_the_kl():
    logp, ref, mask, w_sm, ent = _inputs()
    bad = logp.detach().clone()
    bad[2] = -float("inf")  # an overflowed log-prob on the masked token
    bad.requires_grad_(True)
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="low_var_kl")
    objective, kl, _ = kl_and_entropy_terms(torch.zeros((), dtype=D), bad, None, ref, mask, w_sm, cfg)
    clean, _, _ = kl_and_entropy_terms(torch.zeros((), dtype=D), logp.detach(), None, ref, mask, w_sm, cfg)
    assert torch.isfinite(objective) and objective.item() == clean.item()
    objective.backward()
    assert torch.isfinite(bad.grad).all() and bad.grad[2].item() == 0.0


def test_missing_inputs_name_the_flag():
    logp, ref, mask, w_sm, ent = _inputs()
    pg = torch.zeros((), dtype=D)
    with pytest.raises(
        ValueError, match=r"--use-kl-loss needs ref_log_probs in the batch \(a reference forward pass\)"
    ):
        kl_and_entropy_terms(pg, logp, ent, None, mask, w_sm, LossConfig(use_kl_loss=True, kl_loss_coef=0.1))
    with pytest.raises(ValueError, match="--entropy-coef != 0 needs the entropy"):
        kl_and_entropy_terms(pg, logp, None, ref, mask, w_sm, LossConfig(entropy_coef=0.01))


def _sum_factory(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    """A miles-style reducer: the masked sum over the micro-batch (records what it was given)."""
    _sum_factory.seen = (total_lengths, response_lengths, [m.tolist() for m in loss_masks], calculate_per_token_loss)
    return lambda x: (x * torch.cat(loss_masks)).sum()


@pytest.mark.parametrize("mode, cp, denom", [("sample_mean", 1, 4.0), ("sample_mean", 2, 8.0), ("token_mean", 1, 10.0)])
def test_custom_reducer_is_normalised_by_the_global_count(mode, cp, denom):
    sub = StepBatch(
        tokens=torch.zeros(7, dtype=torch.long),
        total_lengths=torch.tensor([4, 3]),
        response_lengths=torch.tensor([2, 1]),
        loss_mask=torch.ones(3),
        advantages=torch.zeros(3),
        group_ids=torch.tensor([0, 0]),
    )
    counts = StepCounts(4, 10.0, 1, torch.ones(1), torch.ones(1), torch.ones(2))
    cfg = LossConfig(loss_aggregation=mode, custom_pg_reducer=_sum_factory)
    full = torch.tensor([1.0, 2.0, 4.0], dtype=D)
    value = custom_pg_term(full, sub, torch.tensor([1.0, 0.0, 1.0]), cfg, counts, cp)
    assert value.item() == 5.0 / denom
    assert _sum_factory.seen == ([4, 3], [2, 1], [[1.0, 0.0], [1.0]], mode == "token_mean")
