"""Off-policy correction between the engine's sampling policy and the trainer's old policy.

Three policies meet in a step (docs/design.md, "Off-policy data"): the engine's sampling policy
mu (rollout log-probs), the trainer's policy at the start of the rollout pi_old (old log-probs)
and the policy being optimised. PPO/GSPO ratios are taken against pi_old; the train-inference
mismatch pi_old / mu is corrected here by a DETACHED importance weight w that multiplies the
per-token policy loss before aggregation (so every ``--loss-aggregation`` mode applies on top):

    d_t   = log pi_old(y_t) - log mu(y_t)                       (per response token)
    token      rho_t = exp(d_t)                                  (Yao et al. 2025, TIS)
    sequence   rho_i = exp( sum_t m_t d_t )                      (verl "sequence": the full
                                                                  sequence likelihood ratio)
    geometric  rho_i = exp( sum_t m_t d_t / M_i )                (verl "geometric": its
                                                                  length-normalised mean)

and a sequence-level rho_i is carried by every token of sample i. Two modes:

    truncate   w = clip(rho, clip_low, clip_high)                (TIS; clip_low = 0: upper only)
    mask       w = rho if clip_low <= rho <= clip_high, else 0   (MIS / IcePop, Ling 2025:
                                                                  tokens or whole sequences
                                                                  outside the band are dropped)

Departures, stated: the log-weight is clamped to [-20, 20] before ``exp`` (as verl's safety
bound) so a long sequence never overflows (a weight taken at that bound counts as clipped in
``tis/clipped_frac``, wherever the band lies); a masked token keeps its place in every denominator
(the step's counts are global and computed once), so ``mask`` lowers the loss's scale by the
fraction dropped instead of renormalising, and the same holds for the loss masks a custom TIS
function returns (slime rebuilds its sample-mean denominators from them).

The weight depends only on pi_old and mu, which every CP rank holds for FULL responses (the step
batch is never CP-sliced), so sequence-level weights are exact without any collective: they are
built once per step on each rank's full responses and sliced per micro-batch like every other
per-token field.

Mismatch metrics (always measured when both log-probs are present; docs/design.md "Metrics" keeps
diagnostics as sample means):

    mismatch/abs_diff_mean   SampleMean |d_t|             mismatch/abs_diff_max   max_t |d_t|
    mismatch/k3_kl           SampleMean (e^{d} - 1 - d): K3 estimate of KL(mu || pi_old) under y ~ mu
    tis/weight_mean          SampleMean w                 tis/clipped_frac        SampleMean [w != rho]
                                                          (rho the exact ratio: [|log rho| > 20] included)
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch

from rl_plugin.cp import segment_ids
from rl_plugin.registries import TIS_LEVELS, TIS_MODES
from rl_plugin.user_code import load_function

LOG_WEIGHT_BOUND = 20.0


def tis_weights_and_flags(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths: torch.Tensor,
    *,
    level: str,
    mode: str,
    clip_low: float,
    clip_high: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights ``w`` and flags ``[w != rho]`` (float64, ``[sum R_i]``, no grad)."""
    if level not in TIS_LEVELS:
        raise ValueError(f"unknown TIS level {level!r}; choose from {TIS_LEVELS}")
    if mode not in TIS_MODES:
        raise ValueError(f"unknown TIS mode {mode!r}; choose from {TIS_MODES}")
    with torch.no_grad():
        m = loss_mask.detach().to(torch.float64)
        d = (old_log_probs.detach().to(torch.float64) - rollout_log_probs.detach().to(torch.float64)) * m
        if level == "token":
            log_rho = d
        else:
            n = response_lengths.numel()
            sid = segment_ids(response_lengths.long().to(d.device))  # on the device of the log-probs
            seq = torch.zeros(n, dtype=torch.float64, device=d.device).index_add_(0, sid, d)
            if level == "geometric":
                counts = torch.zeros(n, dtype=torch.float64, device=d.device).index_add_(0, sid, m)
                seq = seq / torch.where(counts != 0, counts, torch.ones_like(counts))  # true (fractional) M_i
            log_rho = seq[sid]
        # |log rho| > LOG_WEIGHT_BOUND: the weight is computed from the bound, not from rho, so it
        # is clipped even when it lands inside [clip_low, clip_high] (e.g. --tis-clip above e^20)
        at_bound = log_rho.abs() > LOG_WEIGHT_BOUND
        rho = torch.exp(log_rho.clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND))
        if mode == "truncate":
            w = rho.clamp(clip_low, clip_high)
            flags = ((w != rho) | at_bound).to(torch.float64)
        else:
            keep = (rho >= clip_low) & (rho <= clip_high)
            w = torch.where(keep, rho, torch.zeros_like(rho))
            flags = (~keep | at_bound).to(torch.float64)
        # Masked-out tokens (m = 0) are weighted 0 by every aggregation; report them as unclipped.
        return w, flags * m


def mismatch_terms(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, loss_mask: torch.Tensor
) -> Dict[str, torch.Tensor]:
    """Per-token |d| and K3 terms (float64, zero on masked tokens)."""
    with torch.no_grad():
        m = loss_mask.detach().to(torch.float64)
        d = (old_log_probs.detach().to(torch.float64) - rollout_log_probs.detach().to(torch.float64)) * m
        k3 = (torch.expm1(d.clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND)) - d) * m
        return {"abs_diff": d.abs(), "k3_kl": k3}


def tis_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths,
    *,
    level: str = "token",
    mode: str = "truncate",
    clip_low: float = 0.0,
    clip_high: float = 2.0,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Reference API over one process's flat, concatenated responses: ``(weights [T], metrics)``.

    ``metrics`` are sample means over the given samples (an empty sample counts in N with 0),
    as the distributed step reports them: ``mismatch/abs_diff_mean``, ``mismatch/abs_diff_max``,
    ``mismatch/k3_kl``, ``tis/weight_mean``, ``tis/clipped_frac``.
    """
    response_lengths = torch.as_tensor(response_lengths, dtype=torch.long)
    n_tok = int(response_lengths.sum())
    for name, t in (
        ("old_log_probs", old_log_probs),
        ("rollout_log_probs", rollout_log_probs),
        ("loss_mask", loss_mask),
    ):
        if t.shape[0] != n_tok:
            raise ValueError(f"tis_weights: {name} has {t.shape[0]} entries but response_lengths sum to {n_tok}")
    w, flags = tis_weights_and_flags(
        old_log_probs,
        rollout_log_probs,
        loss_mask,
        response_lengths,
        level=level,
        mode=mode,
        clip_low=clip_low,
        clip_high=clip_high,
    )
    m = loss_mask.detach().to(torch.float64)
    sid = segment_ids(response_lengths)
    s = max(response_lengths.numel(), 1)
    m_i = torch.zeros(response_lengths.numel(), dtype=torch.float64).index_add_(0, sid, m)
    per_sample = 1.0 / (s * torch.where(m_i != 0, m_i, torch.ones_like(m_i)))  # true (fractional) M_i
    w_sm = m * per_sample[sid]
    terms = mismatch_terms(old_log_probs, rollout_log_probs, loss_mask)
    valid = m > 0
    metrics = {
        "mismatch/abs_diff_mean": float((terms["abs_diff"] * w_sm).sum()),
        "mismatch/abs_diff_max": float(terms["abs_diff"][valid].max()) if bool(valid.any()) else None,
        "mismatch/k3_kl": float((terms["k3_kl"] * w_sm).sum()),
        "tis/weight_mean": float((w * w_sm).sum()),
        "tis/clipped_frac": float((flags * w_sm).sum()),
    }
    return w.to(old_log_probs.dtype), metrics


# --- the custom TIS hook (slime-compatible) --------------------------------------------------

CustomTISFunction = Callable[..., Tuple[torch.Tensor, list, dict]]


def load_custom_tis_function(path: str) -> CustomTISFunction:
    """Import ``--custom-tis-function-path`` (any form of ``rl_plugin.user_code.FORMS``). slime's signature::

        fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks,
           total_lengths, response_lengths, **kwargs) -> (pg_loss, loss_masks, metrics)

    ``pg_loss``: the micro-batch's per-token policy loss over FULL responses (gathered over CP,
    differentiable); the three lists hold one tensor per sample (old log-probs, engine
    log-probs, loss mask); ``args`` carries ``tis_clip``, ``tis_clip_low``, ``tis_level`` and
    ``tis_mode``; ``metrics``: name -> per-token tensor, reported as its sample mean under
    ``tis/<name>``.
    """
    return load_function(path, "--custom-tis-function-path")
