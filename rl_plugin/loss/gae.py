"""Generalized advantage estimation over response tokens (Schulman et al. 2016, "High-Dimensional
Continuous Control Using Generalized Advantage Estimation"), for PPO with a learned critic.

Per sample, over its response tokens t = 0 .. T-1 with per-token rewards r_t (the outcome reward
on the last token, a per-token KL penalty folded in), the critic's values V_t, and the mask
m_t (1: a token the policy sampled; 0: a tool / observation token the policy conditioned on):

    delta_t = r_t + gamma * V_next(t) - V_t
    A_t     = delta_t + gamma * lam * A_next(t)
    R_t     = A_t + V_t                                   (the critic's target, "returns")

where next(t) is the next response token AFTER t WITH m = 1 (V and A of a position past the last
such token are 0). So a masked token is skipped: it has no action, its value and TD error take
no part, and the running terms (the next value, the discounted advantage) carry over it as if
the masked span were absent; a reward placed on a masked token is therefore ignored. At a masked
position itself the returned A_t is the carried term (the advantage of the next trained token),
and R_t = A_t + V_t: neither is trained on (the loss masks them), they are only defined. This is
the masking of verl's ``compute_gae_advantage_return`` and TRL's PPO trainer for multi-turn
episodes; padding after a response is a masked tail and gets A = R - V = 0.

Advantages are returned before any whitening (``--normalize-advantages`` whitens over the
step's trained tokens elsewhere). Computed in float64 and returned in the rewards' dtype.
The recursion runs backwards over the T positions, vectorised over the batch (T steps, no loop
over samples).
"""

from __future__ import annotations

from typing import Tuple

import torch


def gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)``, both ``[batch, response_len]``, from ``token_level_rewards``,
    ``values`` and ``response_mask`` of that shape (mask values 0 or 1) and the discount
    ``gamma`` and GAE ``lam`` in [0, 1] (module docstring for the formula and the masking)."""
    if not (token_level_rewards.shape == values.shape == response_mask.shape) or token_level_rewards.dim() != 2:
        raise ValueError(
            "gae: token_level_rewards, values and response_mask must all be [batch, response_len]; got "
            f"{tuple(token_level_rewards.shape)}, {tuple(values.shape)}, {tuple(response_mask.shape)}"
        )
    for name, x in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= float(x) <= 1.0:
            raise ValueError(f"gae: {name} must be in [0, 1], got {x}")
    r, v = token_level_rewards.to(torch.float64), values.detach().to(torch.float64)
    m = response_mask.to(torch.float64)
    batch, length = r.shape
    next_value = torch.zeros(batch, dtype=torch.float64, device=r.device)
    running = torch.zeros(batch, dtype=torch.float64, device=r.device)
    advantages = torch.empty_like(r)
    for t in range(length - 1, -1, -1):
        keep = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        # a trained token starts a new running term; a masked one carries the old one over it
        running = keep * (delta + gamma * lam * running) + (1.0 - keep) * running
        next_value = keep * v[:, t] + (1.0 - keep) * next_value
        advantages[:, t] = running
    returns = advantages + v
    return advantages.to(token_level_rewards.dtype), returns.to(token_level_rewards.dtype)
