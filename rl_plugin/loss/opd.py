"""On-policy distillation's advantage shift and its metrics (``--use-opd``; the flags and the
method: ``rl_plugin.loss_config.opd``). Per response token, ``[sum R_i]`` each:

    A'_t = A_t - coef * m_t * (logp_student_t - logp_teacher_t)

``m_t`` the loss mask: a masked token (tool output, environment text) keeps its advantage, which
no term reads anyway. ``logp_student`` is the old policy's (the step's ``old_log_probs``), so the
shift is a constant of the step, as an advantage must be. Metrics over the step's trained tokens
(token means, whatever ``--loss-aggregation``): ``opd/reverse_kl`` = mean m (student - teacher),
the k1 estimate of KL(student || teacher) on the student's samples, and
``opd/teacher_logprob_mean`` = mean m teacher.
"""

from __future__ import annotations

import torch


def opd_advantages(
    advantages: torch.Tensor,
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    coef: float,
) -> torch.Tensor:
    """``A - coef * m * (student - teacher)`` (module docstring), a new tensor in A's dtype; a
    masked token's log-probs are never read (selected out, so a non-finite one cannot leak)."""
    if not (advantages.shape == student_log_probs.shape == teacher_log_probs.shape == loss_mask.shape):
        raise ValueError(
            "opd_advantages: advantages, student / teacher log-probs and the loss mask must have one entry per "
            f"response token, got {tuple(advantages.shape)}, {tuple(student_log_probs.shape)}, "
            f"{tuple(teacher_log_probs.shape)}, {tuple(loss_mask.shape)}"
        )
    diff = student_log_probs.double() - teacher_log_probs.double()
    shift = torch.where(loss_mask != 0, loss_mask.double() * diff, torch.zeros((), dtype=torch.float64))
    return (advantages.double() - coef * shift).to(advantages.dtype)


OPD_SUMS = ("opd/reverse_kl", "opd/teacher_logprob_mean")


def record_opd_metrics(metrics, student, teacher, loss_mask, total_tokens: float, cp_rank: int) -> None:
    """Add this rank's share of the two token means (module docstring) to ``metrics``; CP ranks
    hold the same full responses, so only CP rank 0 adds."""
    if cp_rank != 0:
        return
    w = loss_mask.double() / (total_tokens or 1.0)
    on = loss_mask != 0
    zero = torch.zeros((), dtype=torch.float64, device=w.device)
    metrics.add("opd/reverse_kl", (torch.where(on, student.double() - teacher.double(), zero) * w).sum())
    metrics.add("opd/teacher_logprob_mean", (torch.where(on, teacher.double(), zero) * w).sum())
