"""The step objective and its terms, for one micro-batch (``StepContext.loss`` assembles them).

    J = J_pg(mode) + kl_coef * SampleMean(kl) - entropy_coef * SampleMean(entropy)

- J_pg: the per-token policy loss (times the detached TIS weight with ``--use-tis``) aggregated
  by ``--loss-aggregation`` (``weighted_sum`` with the mode's per-token weights) or by the custom
  reducer (``custom_pg_term``).
- ``kl_and_entropy_terms``: the KL term (``--use-kl-loss``, estimator ``--kl-loss-type`` against
  the reference log-probs) and the entropy term (``--entropy-coef``), both sample means so they
  compare across runs and aggregation modes.

Each is this micro-batch's share: summed over every micro-batch of every DP x CP rank it is the
step's term, because the weights carry the step's global counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from rl_plugin.loss.aggregation import weighted_sum
from rl_plugin.loss.batch import StepBatch
from rl_plugin.loss.counts import StepCounts
from rl_plugin.loss.kl import kl_estimate
from rl_plugin.loss_config import LossConfig


@dataclass
class MicroBatchLoss:
    """``objective``: this micro-batch's share of J (differentiable)."""

    objective: torch.Tensor


def kl_and_entropy_terms(
    pg_term: torch.Tensor,
    log_probs: torch.Tensor,
    entropy: Optional[torch.Tensor],
    ref_log_probs: Optional[torch.Tensor],
    mask: torch.Tensor,
    w_sm: torch.Tensor,
    cfg: LossConfig,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(objective, kl_term, entropy_term)``: ``pg_term`` plus the KL and entropy terms (None
    when off). ``mask`` and ``w_sm`` (sample-mean weights) are in ``log_probs``' dtype."""
    dtype = log_probs.dtype
    objective = pg_term
    kl_term = entropy_term = None
    if cfg.use_kl_loss:
        if ref_log_probs is None:
            raise ValueError("--use-kl-loss needs ref_log_probs in the batch (a reference forward pass)")
        ref_lp = ref_log_probs.to(dtype)
        # a masked token's log-prob is replaced by the reference's BEFORE the nonlinear
        # estimator, so neither its value nor its gradient (0 * inf) can be non-finite
        kl_term = weighted_sum(kl_estimate(torch.where(mask != 0, log_probs, ref_lp), ref_lp, cfg.kl_loss_type), w_sm)
        objective = objective + cfg.kl_loss_coef * kl_term
    if cfg.entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("--entropy-coef != 0 needs the entropy from log_probs_and_entropy")
        entropy_term = weighted_sum(entropy.to(dtype), w_sm)
        objective = objective - cfg.entropy_coef * entropy_term
    return objective, kl_term, entropy_term


def custom_pg_term(
    full: torch.Tensor,
    sub_batch: StepBatch,
    step_loss_mask: torch.Tensor,
    cfg: LossConfig,
    counts: StepCounts,
    cp_size: int,
) -> torch.Tensor:
    """miles-compatible hook: ``factory(total_lengths, response_lengths, loss_masks,
    calculate_per_token_loss)`` returns ``reducer(x) -> scalar`` over the micro-batch's FULL
    responses ``full`` (gathered over CP, so the user never sees chunks; ``step_loss_mask``: their
    loss mask). Its value is a sum over the micro-batch, normalised here by the global N (or
    global tokens in per-token mode); each CP rank holds the same value, so it is divided by
    ``cp_size``."""
    rl = sub_batch.response_lengths.long()
    loss_masks = list(step_loss_mask.split(rl.tolist()))
    reducer = cfg.custom_pg_reducer(
        sub_batch.total_lengths.tolist(), rl.tolist(), loss_masks, cfg.calculate_per_token_loss
    )
    denom = (counts.total_tokens or 1.0) if cfg.calculate_per_token_loss else float(counts.num_samples)
    return reducer(full) / (denom * cp_size)
