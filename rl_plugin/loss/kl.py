"""KL estimators between the current policy and a reference, per token (Schulman 2020,
"Approximating KL divergence"): with log-ratio d = logp - logp_ref,

    k1          = d
    k2          = d^2 / 2
    k3          = exp(-d) - 1 + d                     (unbiased, non-negative)
    low_var_kl  = clamp(k3 with d clamped to [-20, 20], -10, 10)   (the clamped k3 of verl/slime)

Each is registered by name in ``rl_plugin.registries.KL_ESTIMATORS`` (``--kl-loss-type``).
"""

from __future__ import annotations

import torch

from rl_plugin.registries import KL_ESTIMATORS


def k1(d: torch.Tensor) -> torch.Tensor:
    return d


def k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d * d


def k3(d: torch.Tensor) -> torch.Tensor:
    return torch.exp(-d) - 1.0 + d


def low_var_kl(d: torch.Tensor) -> torch.Tensor:
    d = d.clamp(-20.0, 20.0)
    return (torch.exp(-d) - 1.0 + d).clamp(-10.0, 10.0)


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    estimator = KL_ESTIMATORS.get(kind)  # an unknown kind names --kl-loss-type and the choices
    return estimator(log_probs - ref_log_probs)
