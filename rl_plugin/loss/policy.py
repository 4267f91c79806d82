"""Policy-gradient losses, registered by name (``rl_plugin.registries.POLICY_LOSSES``). Each returns ``(per_token_loss, clipped)``.

Per-token outputs let any aggregation mode (``aggregation.py``) apply on top.

PPO clip (Schulman et al. 2017), token level, with the asymmetric "clip-higher" bound of DAPO
(Yu et al. 2025) and the dual clip of Ye et al. 2020:

    r_t   = exp(logp_t - logp_old_t)
    l_t   = max(-A_t r_t, -A_t clip(r_t, 1 - eps, 1 + eps_high))
    l_t   = min(l_t, -A_t c)         for A_t < 0, when eps_clip_c = c > 1 is set

GSPO (Zheng et al. 2025), sequence level: the importance ratio is the length-normalised
sequence likelihood ratio

    s_i   = exp( sum_t m_t (logp_t - logp_old_t) / M_i )
    l_i,t = max(-A_t s_i, -A_t clip(s_i, 1 - eps, 1 + eps_high))    for every token t of sample i

so every token of sample i carries the sequence loss; with ``sample_mean`` aggregation this is
exactly the paper's objective (1/N) sum_i l_i, with ``token_mean`` its length-weighted variant.
Departure from the paper: advantages are read per token (the paper's A_i when constant over the
sample). Under context parallelism the numerator sum_t m (logp - logp_old) is a per-sample
partial sum on each CP rank; only that ``[S]`` vector is all-reduced (differentiably) over the
CP group, and M_i is the full-sequence count (the true, possibly fractional, mask total; only
M_i = 0 is replaced by 1). Tokens whose sample id is out of range (padding) are dropped from
every sum.

SFT (``--loss-type sft_loss``, registered as ``sft_nll``): l_t = -logp_t, the NLL of the target
token; no ratio, no advantage, nothing clipped. The aggregation modes apply to it unchanged.

Overflow guard (as verl's ``compute_policy_loss``, bound 20): every log-ratio is clamped to
[-20, 20] before ``exp`` (per token, and GSPO's sequence log-ratio too), so r <= e^20 ~ 4.9e8 is
finite; the clamp is the identity (value and gradient) inside the bound. A masked token is
selected out (``torch.where``), never multiplied by its zero mask, in GSPO's per-sample sum; the
step weights do the same for every term (``aggregation.weighted_sum``). verl clamps GSPO's
sequence log-ratio at +10 only; one symmetric bound is used here for both losses.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from rl_plugin.cp import segment_ids
from rl_plugin.loss.comm import all_reduce_sum
from rl_plugin.registries import POLICY_LOSSES  # the names; entries point at the functions below

LOG_RATIO_BOUND = 20.0


def clamped_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> torch.Tensor:
    """``clamp(logp - logp_old, -20, 20)``: ``exp`` of it never overflows (module docstring)."""
    return (log_probs - old_log_probs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


PolicyLossFn = Callable[..., Tuple[torch.Tensor, torch.Tensor]]


def register_policy_loss(name: str):
    """``@register_policy_loss(name)``: add your own loss to ``rl_plugin.registries.POLICY_LOSSES``."""
    return POLICY_LOSSES.register(name)


def get_policy_loss(name: str) -> PolicyLossFn:
    return POLICY_LOSSES.get(name)


def _clipped_objective(ratio, advantages, eps_clip, eps_clip_high, eps_clip_c):
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    loss = torch.maximum(pg1, pg2)
    clipped = (pg2 > pg1).to(ratio.dtype)
    if eps_clip_c is not None:
        pg3 = -advantages * eps_clip_c
        dual = (advantages < 0) & (pg3 < loss)
        loss = torch.where(advantages < 0, torch.minimum(loss, pg3), loss)
        clipped = torch.where(dual, torch.ones_like(clipped), clipped)
    return loss, clipped


def ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: Optional[float] = None,
    eps_clip_c: Optional[float] = None,
    **_unused,
) -> Tuple[torch.Tensor, torch.Tensor]:
    ratio = torch.exp(clamped_log_ratio(log_probs, old_log_probs))
    return _clipped_objective(ratio, advantages.to(ratio.dtype), eps_clip, eps_clip_high, eps_clip_c)


def gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths: Optional[torch.Tensor] = None,
    *,
    eps_clip: float,
    eps_clip_high: Optional[float] = None,
    eps_clip_c: Optional[float] = None,
    sample_ids: Optional[torch.Tensor] = None,
    num_samples: Optional[int] = None,
    sample_token_counts: Optional[torch.Tensor] = None,
    cp_group=None,
    **_unused,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Single process: pass ``response_lengths``. Under CP: pass ``sample_ids`` (local token ->
    sample), ``num_samples``, the full-sequence ``sample_token_counts`` M_i and ``cp_group``."""
    if sample_ids is None:
        if response_lengths is None:
            raise ValueError("gspo_loss needs response_lengths or sample_ids")
        response_lengths = torch.as_tensor(response_lengths, dtype=torch.long)
        num_samples = response_lengths.numel()
        sample_ids = segment_ids(response_lengths)
    if num_samples is None:
        raise ValueError("gspo_loss: num_samples is required with sample_ids")
    dtype = log_probs.dtype
    m = loss_mask.to(dtype)
    # Padding tokens (id outside [0, S)) go to a dump bin S that no sample reads.
    bins = torch.where((sample_ids >= 0) & (sample_ids < num_samples), sample_ids, num_samples)
    d = torch.where(m != 0, clamped_log_ratio(log_probs, old_log_probs), log_probs.new_zeros(()))
    partial = torch.zeros(num_samples + 1, dtype=dtype, device=log_probs.device).index_add(0, bins, m * d)
    seq_log_ratio = all_reduce_sum(partial[:num_samples], cp_group)
    if sample_token_counts is None:
        counts = torch.zeros(num_samples + 1, dtype=dtype, device=log_probs.device).index_add(0, bins, m.detach())[
            :num_samples
        ]
        counts = all_reduce_sum(counts, cp_group)
    else:
        counts = sample_token_counts.to(dtype)
    counts = torch.where(counts != 0, counts, torch.ones_like(counts))  # true M_i; 0 only with a zero sum
    seq_ratio = torch.exp((seq_log_ratio / counts).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    seq_ratio = torch.cat([seq_ratio, seq_ratio.new_ones(1)])[bins]
    loss, clipped = _clipped_objective(seq_ratio, advantages.to(dtype), eps_clip, eps_clip_high, eps_clip_c)
    return loss * (bins < num_samples).to(dtype), clipped


def sft_nll_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, **_unused):
    """SFT's per-token loss ``-log p(y_t)`` (``[T]``) and no clipping (zeros): ``--loss-type sft_loss``."""
    return -log_probs, torch.zeros_like(log_probs)
