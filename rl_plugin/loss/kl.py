"""KL estimators between the current policy and a reference, per token (Schulman 2020,
"Approximating KL divergence"): with log-ratio d = logp - logp_ref,

    k1          = d
    k2          = d^2 / 2
    k3          = exp(-d) - 1 + d                     (unbiased, non-negative)
    low_var_kl  = clamp(k3 with d clamped to [-20, 20], -10, 10)   (the clamped k3 of verl/slime)
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    d = log_probs - ref_log_probs
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.exp(-d) - 1.0 + d
    if kind == "low_var_kl":
        d = d.clamp(-20.0, 20.0)
        return (torch.exp(-d) - 1.0 + d).clamp(-10.0, 10.0)
    raise ValueError(f"unknown --kl-loss-type {kind!r}; choose from {KL_ESTIMATORS}")
