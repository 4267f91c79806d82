"""Advantage estimators over whole prompt groups, registered by name (``--advantage-estimator``,
``rl_plugin.registries.ADVANTAGE_ESTIMATORS``).

Rewards r_i of N samples with group ids g(i), group size n_g, group mean mu_g, std sigma_g:

    grpo                          A_i = (r_i - mu_g) / (sigma_g + eps)       (Shao et al. 2024)
    gspo                          same as grpo (GSPO changes the ratio, not the advantage)
    dr_grpo                       A_i = r_i - mu_g                           (Liu et al. 2025)
    rloo                          A_i = r_i - mean_{j in g, j != i} r_j = n_g/(n_g - 1) (r_i - mu_g)
                                                                            (Ahmadian et al. 2024)
    reinforce_plus_plus_baseline  A_i = r_i - mu_g, then whitened over all response tokens of the
                                  batch: (A - mean_tok) / (std_tok + eps)   (Hu 2025, REINFORCE++)

sigma_g is the unbiased std (torch's default, as in the GRPO reference code). Every estimator is
vectorised with ``index_add``; a group of one sample gets A = 0 (grpo/dr_grpo/rloo).
Advantages are then broadcast to every response token (``to_tokens``). PPO with a critic
estimates per token instead: ``gae`` (``gae.py``), re-exported here.
"""

from __future__ import annotations

from typing import Optional

import torch

from rl_plugin.cp import segment_ids
from rl_plugin.loss.gae import gae  # noqa: F401 - PPO's estimator over tokens, ``rl_plugin.loss.advantages.gae``
from rl_plugin.registries import ADVANTAGE_ESTIMATORS  # the names; entries point at the functions below

EPS = 1e-6


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor):
    g = int(group_ids.max()) + 1 if group_ids.numel() else 0
    r = rewards.to(torch.float64)
    n = torch.zeros(g, dtype=torch.float64).index_add_(0, group_ids, torch.ones_like(r))
    mean = torch.zeros(g, dtype=torch.float64).index_add_(0, group_ids, r) / n.clamp_min(1)
    sq = torch.zeros(g, dtype=torch.float64).index_add_(0, group_ids, (r - mean[group_ids]) ** 2)
    std = torch.sqrt(sq / (n - 1).clamp_min(1))
    return n[group_ids], mean[group_ids], std[group_ids]


def grpo_advantages(rewards, group_ids, **_):
    _, mean, std = _group_stats(rewards, group_ids)
    return ((rewards.to(torch.float64) - mean) / (std + EPS)).to(rewards.dtype)


def dr_grpo_advantages(rewards, group_ids, **_):
    _, mean, _ = _group_stats(rewards, group_ids)
    return (rewards.to(torch.float64) - mean).to(rewards.dtype)


def rloo_advantages(rewards, group_ids, **_):
    n, mean, _ = _group_stats(rewards, group_ids)
    scale = torch.where(n > 1, n / (n - 1).clamp_min(1), torch.zeros_like(n))
    return (scale * (rewards.to(torch.float64) - mean)).to(rewards.dtype)


def reinforce_pp_baseline_advantages(rewards, group_ids, *, response_lengths=None, loss_mask=None, **_):
    _, mean, _ = _group_stats(rewards, group_ids)
    centred = rewards.to(torch.float64) - mean
    if response_lengths is None:
        weights = torch.ones_like(centred)
    else:  # whiten over tokens: a sample's advantage counts once per masked response token
        sid = segment_ids(response_lengths)
        m = torch.ones(sid.numel(), dtype=torch.float64) if loss_mask is None else loss_mask.to(torch.float64)
        weights = torch.zeros_like(centred).index_add_(0, sid, m)
    total = weights.sum().clamp_min(1)
    mu = (weights * centred).sum() / total
    var = (weights * (centred - mu) ** 2).sum() / (total - 1).clamp_min(1)
    return ((centred - mu) / (var.sqrt() + EPS)).to(rewards.dtype)


def compute_advantages(
    estimator: str,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    response_lengths: Optional[torch.Tensor] = None,
    loss_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-sample advantages ``[N]``; rewards must be finite (the failing sample is named)."""
    bad = torch.nonzero(~torch.isfinite(rewards)).flatten()
    if bad.numel():
        raise ValueError(f"sample {int(bad[0])}: reward {rewards[bad[0]].item()} is not finite")
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
    return fn(rewards, group_ids.long(), response_lengths=response_lengths, loss_mask=loss_mask)


def to_tokens(per_sample: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-sample value to every response token (``[sum R_i]``)."""
    return torch.repeat_interleave(per_sample, torch.as_tensor(response_lengths).long())
