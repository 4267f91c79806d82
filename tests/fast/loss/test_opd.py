"""Issue 35, on-policy distillation in the loss core (``--use-opd``): the advantage shift
A - coef * m * (log p_student - log p_teacher) checked exactly against a hand computation (masked
tool tokens keep their advantage), applied on top of the estimator's advantages inside the step,
its two token-mean metrics, and the rule that OPD keeps the separate old-log-prob pass."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.loss import LossConfig, StepBatch, prepare_step
from rl_plugin.loss.off_policy_step import old_from_forward_unsupported
from rl_plugin.loss.opd import opd_advantages
from rl_plugin.parallel import ParallelState

ADV = [0.5, 0.5, 0.5, -1.0, -1.0]
STUDENT = [-0.25, -1.5, -2.0, -0.5, -3.0]
TEACHER = [-0.75, -1.0, -9.0, -0.5, -1.0]
MASK = [1.0, 1.0, 0.0, 1.0, 1.0]  # token 2: tool output (a wildly different teacher log-prob, ignored)


def test_advantage_shift_is_the_hand_computation():
    got = opd_advantages(torch.tensor(ADV), torch.tensor(STUDENT), torch.tensor(TEACHER), torch.tensor(MASK), coef=2.0)
    # by hand: A - 2 * m * (s - t)
    want = [0.5 - 2 * 0.5, 0.5 - 2 * (-0.5), 0.5, -1.0 - 0.0, -1.0 - 2 * (-2.0)]
    assert got.tolist() == want == [-0.5, 1.5, 0.5, -1.0, 3.0]
    with pytest.raises(ValueError, match="one entry per response token"):
        opd_advantages(torch.zeros(5), torch.zeros(4), torch.zeros(5), torch.ones(5), 1.0)


def _batch(**kw):
    base = dict(
        tokens=torch.arange(9) % 5,
        total_lengths=torch.tensor([5, 4]),
        response_lengths=torch.tensor([3, 2]),
        loss_mask=torch.tensor(MASK),
        advantages=torch.tensor(ADV),
        group_ids=torch.tensor([0, 0]),
        old_log_probs=torch.tensor(STUDENT),
        teacher_log_probs=torch.tensor(TEACHER),
    )
    base.update(kw)
    return StepBatch(**base)


def test_step_shifts_the_estimators_advantages_and_reports_the_token_means():
    cfg = LossConfig(use_opd=True, opd_kl_coef=1.0, loss_aggregation="token_mean")
    ctx = prepare_step(_batch(), cfg, ParallelState.single())
    assert ctx.advantages.tolist() == [0.0, 1.0, 0.5, -1.0, 1.0]  # A - (s - t) on the trained tokens
    mb = ctx.micro_batch([0, 1])
    assert mb.advantages.tolist() == ctx.advantages.tolist()  # what the policy loss reads
    ctx.loss(torch.tensor(STUDENT, dtype=torch.float64), None, mb)
    report = ctx.finish()
    trained = [i for i, m in enumerate(MASK) if m]
    rkl = sum(STUDENT[i] - TEACHER[i] for i in trained) / len(trained)
    assert report["opd/reverse_kl"] == pytest.approx(rkl, rel=1e-12) == (0.5 - 0.5 + 0 - 2.0) / 4
    assert report["opd/teacher_logprob_mean"] == pytest.approx(sum(TEACHER[i] for i in trained) / 4, rel=1e-12)
    # at ratio 1 (logp = old) the token loss is -A': the step's pg loss is minus the shifted mean
    assert report["pg_loss"] == pytest.approx(-(0.0 + 1.0 - 1.0 + 1.0) / 4, rel=1e-12)


def test_missing_teacher_log_probs_and_old_from_forward_are_refused():
    cfg = LossConfig(use_opd=True)
    with pytest.raises(ValueError, match="no teacher_log_probs"):
        prepare_step(_batch(teacher_log_probs=None), cfg, ParallelState.single())
    with pytest.raises(ValueError, match="no old_log_probs"):
        prepare_step(_batch(old_log_probs=None), cfg, ParallelState.single())
    assert "--use-opd shifts the advantages" in old_from_forward_unsupported(cfg, 1, False)
    assert old_from_forward_unsupported(LossConfig(), 1, False) is None
