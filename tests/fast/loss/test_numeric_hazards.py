"""Regression tests of issue 9's numeric hazards, one per bug (each named after it):
fractional loss masks, an overflowing log-ratio on a masked token, a target id outside the
vocabulary. (The token-budget plans live in loss/test_micro_batch_plan.py, the TP=2 sequence-parallel head in
backends/megatron/test_fp32_head.py, dropout in backends/fsdp/test_model.py, EOS ids in rollout/engines/test_hf_engine.py,
the bf16 logits rows in backends/megatron/test_backend.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from rl_plugin.loss import (
    BadBatchError,
    LossConfig,
    StepBatch,
    aggregate,
    gspo_loss,
    log_probs_and_entropy,
    ppo_clip_loss,
    prepare_step,
)
from rl_plugin.loss.fused_head import fused_log_probs_and_entropy
from rl_plugin.loss.logprobs import TargetOutOfVocabError
from rl_plugin.parallel import ParallelState
from tests.support.tolerance import FP64, within

# -- fractional loss masks --------------------------------------------------------------------


def test_fractional_loss_mask_normalises_by_true_masked_total():
    """mask [.25, .25 | 0]: sample 0's mask sums to 0.5, sample 1 is all-masked. A constant loss c
    gives c per non-empty sample (sample_mean c/2: N = 2 counts the empty one; token_mean c);
    the old clamp of M_i to 1 halved both (c/4, c/2)."""
    c = 3.0
    x = torch.full((3,), c, dtype=torch.float64)
    mask = torch.tensor([0.25, 0.25, 0.0], dtype=torch.float64)
    lengths = [2, 1]
    assert float(aggregate(x, mask, lengths, "sample_mean")) == c / 2
    assert float(aggregate(x, mask, lengths, "token_mean")) == c
    assert float(aggregate(x, mask, lengths, "prompt_mean", group_ids=[0, 1])) == c / 2
    assert float(aggregate(x, mask, lengths, "prompt_mean", group_ids=[0, 0])) == c
    # weighted mean with soft weights: (0.25 * 1 + 0.75 * 3) / 1.0 over one sample
    y = torch.tensor([1.0, 3.0], dtype=torch.float64)
    assert float(aggregate(y, torch.tensor([0.25, 0.75], dtype=torch.float64), [2], "sample_mean")) == 2.5
    # the step weights (prepare_step: global counts, per-token weights) agree with aggregate
    batch = StepBatch(
        tokens=torch.arange(7) % 5,
        total_lengths=torch.tensor([4, 3]),
        response_lengths=torch.tensor([2, 1]),
        loss_mask=mask,
        advantages=torch.zeros(3),
        group_ids=torch.tensor([0, 1]),
    )
    for mode in ("sample_mean", "token_mean"):
        ctx = prepare_step(batch, LossConfig(loss_aggregation=mode), ParallelState.single())
        assert float((ctx.pg_weights * x).sum()) == float(aggregate(x, mask, lengths, mode)), mode
    assert ctx.counts.sample_tokens.tolist() == [0.5, 0.0] and ctx.counts.total_tokens == 0.5


def test_fractional_loss_mask_gspo_sequence_ratio_uses_true_total():
    """GSPO's s_i = exp(sum_t m_t d_t / M_i) with M_i = 0.5 (was divided by max(M_i, 1))."""
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    old = torch.tensor([-1.2, -2.2], dtype=torch.float64)  # d = 0.2 on both tokens
    mask = torch.tensor([0.25, 0.25], dtype=torch.float64)
    adv = torch.ones(2, dtype=torch.float64)
    loss, _ = gspo_loss(logp, old, adv, mask, [2], eps_clip=10.0)
    assert within(float(loss[0]), -math.exp(0.2), rtol=FP64)  # exp: fp64 elementwise


def test_negative_or_nan_loss_mask_is_refused_naming_the_sample():
    x = torch.ones(4, dtype=torch.float64)
    with pytest.raises(BadBatchError, match=r"sample 1: loss_mask\[0\] = -0.5; a loss mask must be finite and >= 0"):
        aggregate(x, torch.tensor([1.0, 1.0, -0.5, 1.0], dtype=torch.float64), [2, 2], "sample_mean")
    with pytest.raises(BadBatchError, match=r"sample 0: loss_mask\[1\] = nan"):
        aggregate(x, torch.tensor([1.0, math.nan, 0.5, 1.0], dtype=torch.float64), [2, 2], "token_mean")


# -- an overflowing log-ratio on a masked token -----------------------------------------------


def _overflow_case():
    """Three samples; token 1 (masked) has logp - old = 800: exp overflows to inf in fp64 unless
    clamped; token 6 (masked) has logp = -inf (0 * -inf = NaN in GSPO's sequence sum unless
    selected out); token 4 (unmasked) has a log-ratio of -50 (below the bound)."""
    logp = torch.tensor([-1.0, 799.0, -2.0, -0.5, -60.0, -1.5, -math.inf], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.1, -1.0, -2.0, -0.4, -10.0, -1.5, -3.0], dtype=torch.float64)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, 0.5, 0.5], dtype=torch.float64)
    return logp, old, mask, adv, [3, 2, 2]


@pytest.mark.parametrize("loss_name", ["ppo_clip", "gspo"])
def test_overflowing_log_ratio_on_masked_token_keeps_J_finite(loss_name):
    logp, old, mask, adv, lengths = _overflow_case()
    if loss_name == "ppo_clip":
        tok, _ = ppo_clip_loss(logp, old, adv, eps_clip=0.2)
    else:
        tok, _ = gspo_loss(logp, old, adv, mask, lengths, eps_clip=0.2)
    assert bool(torch.isfinite(tok).all())  # the ratio is clamped to exp(20) at most
    for mode in ("sample_mean", "token_mean"):
        j = aggregate(tok, mask, lengths, mode)
        (g,) = torch.autograd.grad(j, logp, retain_graph=True)
        assert math.isfinite(float(j.detach())) and bool(torch.isfinite(g).all()), mode
        assert float(g[1]) == 0.0 and float(g[6]) == 0.0  # the masked tokens get no gradient
    # the unmasked tokens' J is what the same data without the masked outliers gives
    ok = logp.detach().clone()
    ok[1], ok[6] = old[1], old[6]
    ref_tok = (
        ppo_clip_loss(ok, old, adv, eps_clip=0.2)[0]
        if loss_name == "ppo_clip"
        else gspo_loss(ok, old, adv, mask, lengths, eps_clip=0.2)[0]
    )
    assert float(aggregate(tok, mask, lengths, "sample_mean").detach()) == float(
        aggregate(ref_tok, mask, lengths, "sample_mean")
    )


def test_aggregate_never_multiplies_a_non_finite_masked_term_by_zero():
    x = torch.tensor([1.0, math.inf, 2.0, math.nan], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    for mode in ("sample_mean", "token_mean", "prompt_mean", "constant"):
        j = aggregate(x, mask, [2, 2], mode, divisor=2.0)
        (g,) = torch.autograd.grad(j, x)
        assert math.isfinite(float(j.detach())) and g.tolist()[1] == 0.0 and g.tolist()[3] == 0.0, mode


@pytest.mark.parametrize("loss_name", ["ppo_clip", "gspo"])
def test_overflowing_log_ratio_on_masked_token_keeps_step_and_metrics_finite(loss_name):
    """The step path (prepare_step -> loss -> finish): J, its gradient, the KL term and the
    ratio metrics stay finite with the masked outlier."""
    logp, old, mask, adv, lengths = _overflow_case()
    rl = torch.tensor(lengths)
    batch = StepBatch(
        tokens=torch.arange(int(rl.sum()) + 3) % 7,
        total_lengths=rl + 1,
        response_lengths=rl,
        loss_mask=mask,
        advantages=adv,
        group_ids=torch.tensor([0, 0, 1]),
        old_log_probs=old,
        ref_log_probs=old.clone(),
    )
    cfg = LossConfig(
        policy_loss=loss_name, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3", pg_metrics="with_entropy"
    )
    ctx = prepare_step(batch, cfg, ParallelState.single())
    mb = ctx.micro_batch(torch.arange(3))
    out = ctx.loss(logp, torch.zeros(7, dtype=torch.float64), mb)
    (g,) = torch.autograd.grad(out.objective, logp)
    report = ctx.finish()
    assert math.isfinite(float(out.objective.detach())) and bool(torch.isfinite(g).all()) and float(g[1]) == 0.0
    for key in ("loss", "pg_loss", "kl_loss", "ratio_mean", "ratio_sum", "ratio_sq_sum", "ppo_kl", "pg_clipfrac"):
        assert math.isfinite(report[key]), (key, report[key])


# -- a target id outside the vocabulary -------------------------------------------------------

V = 11


def _logits():
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(4, V, generator=g, dtype=torch.float64),
        torch.randn(4, 6, generator=g, dtype=torch.float64),
        torch.randn(V, 6, generator=g, dtype=torch.float64),
    )


@pytest.mark.parametrize("bad", [V, -1])
def test_target_id_outside_vocab_fails_loud(bad):
    logits, hidden, weight = _logits()
    targets = torch.tensor([0, 3, bad, V - 1])
    msg = rf"target token id {bad} \(response row 2 of this micro-batch\) is outside the vocabulary \[0, {V}\)"
    with pytest.raises(TargetOutOfVocabError, match=msg):
        log_probs_and_entropy(logits, targets)
    with pytest.raises(TargetOutOfVocabError, match=msg):
        fused_log_probs_and_entropy(hidden, weight, targets)
    ok = targets.clone()
    ok[2] = 5
    assert bool(torch.isfinite(log_probs_and_entropy(logits, ok)[0]).all())


def _vocab_tp_worker(rank, world):
    ps = ParallelState.from_world(tp=world, cp=1, dp=1)
    logits, hidden, weight = _logits()
    lo, hi = [(0, 6), (6, V)][rank]  # uneven shards
    out = {}
    for bad in (V, 4):  # V: outside every shard; 4: inside rank 0's shard only (valid)
        targets = torch.tensor([0, bad, 7, V - 1])
        for name, fn in (
            (
                "logits",
                lambda targets=targets: log_probs_and_entropy(
                    logits[:, lo:hi], targets, tp_group=ps.tp_group, vocab_start=lo, chunk_size=2
                ),
            ),
            (
                "fused",
                lambda targets=targets: fused_log_probs_and_entropy(
                    hidden, weight[lo:hi], targets, tp_group=ps.tp_group, vocab_start=lo, chunk_size=2
                ),
            ),
        ):
            try:
                fn()
                out[(name, bad)] = "ok"
            except TargetOutOfVocabError as e:
                out[(name, bad)] = str(e)
    return out


def test_target_id_outside_vocab_fails_loud_under_tp2(run_world):
    """Each TP rank sees only its shard: the check is global (both ranks raise, naming the full
    vocabulary size), and a target in the other rank's shard is not mistaken for a bad one."""
    for out in run_world(_vocab_tp_worker, 2):
        for name in ("logits", "fused"):
            assert out[(name, 4)] == "ok"
            want = f"target token id {V} (response row 1 of this micro-batch) is outside the vocabulary [0, {V})"
            assert want in out[(name, V)]
