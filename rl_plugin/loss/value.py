"""The critic's clipped value loss (PPO, Schulman et al. 2017; the value clipping of OpenAI's
baselines ``ppo2``), aggregated by the same core as the policy loss.

Per response token with the critic's new prediction v'_t (``vpreds``), the prediction at rollout
time v_t (``values``, the "old values"), the GAE target R_t (``returns``) and the clip range c:

    v_clip_t = v_t + clamp(v'_t - v_t, -c, c)
    l_t      = 0.5 * max((v'_t - R_t)^2, (v_clip_t - R_t)^2)
    loss     = the --loss-aggregation mode's J over l and the response mask (``aggregation.py``)
    clipfrac = the masked token mean of [ (v_clip_t - R_t)^2 > (v'_t - R_t)^2 ]

so the four modes mean what they mean for the policy term (``sample_mean``: each sample's token
mean, averaged over samples; ``token_mean``; ``prompt_mean`` with ``group_ids``; ``constant`` with
``divisor``). ``clipfrac`` is a diagnostic: a token mean in every mode. ``returns`` and ``values``
carry no gradient; only ``vpreds`` does.

This is the single-process reference over ``[batch, response_len]`` tensors (padding masked
out); a distributed step weighs the same per-token losses with the step's global counts
(``token_weights``), as the policy loss does.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from rl_plugin.loss.aggregation import aggregate


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    aggregation: str,
    *,
    group_ids: Optional[torch.Tensor] = None,
    divisor: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(loss, clipfrac)`` for ``[batch, response_len]`` ``vpreds`` / ``returns`` / ``values`` /
    ``response_mask``; ``aggregation`` one of ``--loss-aggregation``'s modes, ``group_ids``
    (``[batch]``) for ``prompt_mean``, ``divisor`` for ``constant`` (module docstring)."""
    if not (vpreds.shape == returns.shape == values.shape == response_mask.shape) or vpreds.dim() != 2:
        raise ValueError(
            "value_loss: vpreds, returns, values and response_mask must all be [batch, response_len]; got "
            f"{tuple(vpreds.shape)}, {tuple(returns.shape)}, {tuple(values.shape)}, {tuple(response_mask.shape)}"
        )
    per_token, hit = value_loss_terms(vpreds, returns, values, cliprange_value)
    batch, length = vpreds.shape
    mask = response_mask.to(per_token.dtype).reshape(-1)
    loss = aggregate(per_token.reshape(-1), mask, [length] * batch, aggregation, group_ids=group_ids, divisor=divisor)
    trained = mask.sum()
    clipfrac = (hit.to(per_token.dtype).reshape(-1) * mask).sum().detach() / trained.clamp_min(1)
    return loss, clipfrac


def value_loss_terms(
    vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor, cliprange_value: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(l, clipped)`` per token, any (equal) shape: l_t = 0.5 * max((v'_t - R_t)^2, (v_clip_t -
    R_t)^2) and the bool ``clipped`` = [(v_clip_t - R_t)^2 > (v'_t - R_t)^2] (module docstring),
    counted only where |v'_t - v_t| > c: inside the range v_clip_t is v'_t up to the rounding of
    v_t + (v'_t - v_t), which must not count. Gradient through ``vpreds`` only. The distributed
    value step (``value_step``) weighs the same terms with the step's global token weights."""
    if not cliprange_value > 0:
        raise ValueError(f"value_loss: cliprange_value must be > 0 (--value-clip), got {cliprange_value}")
    returns, values = returns.detach(), values.detach()
    clipped = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
    unclipped_err = (vpreds - returns) ** 2
    clipped_err = (clipped - returns) ** 2
    outside = (vpreds.detach() - values).abs() > cliprange_value
    return 0.5 * torch.maximum(unclipped_err, clipped_err), outside & (clipped_err > unclipped_err)
