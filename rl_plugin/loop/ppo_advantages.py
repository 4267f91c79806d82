"""PPO's per-token advantages from a learned critic, over one rollout (``--advantage-estimator ppo``).

Per rollout, on the driver, after the critic's forward (the "old" values ``V``, before any update)
and, with ``--kl-coef`` > 0, the actor's old and reference log-probs::

    r_t = [t == last trained token of the sample] * reward_i  -  kl_coef * (old_t - ref_t)
    A, R = rl_plugin.loss.advantages.gae(r, V, loss_mask, gamma, lambd)        (per sample)
    A   <- (A - mean_m(A)) / (std_m(A) + 1e-8)        with --normalize-advantages

where ``m`` is the rollout's loss mask (1: a token the policy sampled, 0: a tool / observation
token a multi-turn hook appended) and ``mean_m`` / ``std_m`` (unbiased) run over every trained
token of the rollout. The outcome reward sits on the LAST TRAINED token of each response (its last
token unless a hook appended masked tokens after it: ``gae`` ignores a reward on a masked token).
``explained_variance`` = 1 - Var_m(R - V) / Var_m(R), the critic's fit (1: perfect; 0: no
better than the mean). Everything here is a pure function of flat ``[sum R_i]`` per-token tensors
(the ``StepBatch`` layout); the padding to ``gae``'s ``[batch, response_len]`` is vectorised.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, Optional, Tuple

import torch

from rl_plugin import loss as loss_core  # its ``gae`` (a module of that name too: not imported by name)
from rl_plugin.loss import StepBatch

WHITEN_EPS = 1e-8


def to_padded(flat: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
    """``[sum R_i]`` -> ``[B, max R_i]`` (zeros past each response's end)."""
    lengths = response_lengths.long()
    rows, cols = _positions(lengths)
    out = flat.new_zeros((lengths.numel(), int(lengths.max()) if lengths.numel() else 0))
    out[rows, cols] = flat
    return out


def from_padded(padded: torch.Tensor, response_lengths: torch.Tensor) -> torch.Tensor:
    """``[B, max R_i]`` -> ``[sum R_i]`` (the inverse of ``to_padded``)."""
    rows, cols = _positions(response_lengths.long())
    return padded[rows, cols]


def _positions(lengths: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each flat token's (sample, position in its response)."""
    rows = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths)
    return rows, cols


def token_level_rewards(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor,
    loss_mask: torch.Tensor,
    kl_coef: float = 0.0,
    old_log_probs: Optional[torch.Tensor] = None,
    ref_log_probs: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``[sum R_i]`` fp32: sample i's reward on its last trained token (its last token when none is
    trained), minus ``kl_coef * (old - ref)`` on every token when ``kl_coef`` > 0 (module docstring)."""
    lengths = response_lengths.long()
    rows, cols = _positions(lengths)
    trained_pos = torch.where(loss_mask > 0, cols, torch.full_like(cols, -1))
    last = torch.full((lengths.numel(),), -1, dtype=torch.long).scatter_reduce(0, rows, trained_pos, "amax")
    last = torch.where(last < 0, lengths - 1, last)
    out = torch.zeros(int(lengths.sum()), dtype=torch.float32)
    starts = torch.cumsum(lengths, 0) - lengths
    out[starts + last] = rewards.float()
    if kl_coef > 0:
        if old_log_probs is None or ref_log_probs is None:
            raise ValueError("token_level_rewards: kl_coef > 0 needs the old and the reference log-probs")
        out = out - kl_coef * (old_log_probs.float() - ref_log_probs.float())
    return out


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean_m(x)) / (std_m(x) + 1e-8)`` over the tokens with ``mask`` 1 (unbiased std),
    applied to every token; unchanged when fewer than 2 tokens are trained."""
    m = mask > 0
    n = int(m.sum())
    if n < 2:
        return x
    sel = x[m].double()
    mean, std = sel.mean(), sel.std(unbiased=True)
    return ((x.double() - mean) / (std + WHITEN_EPS)).to(x.dtype)


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var_m(returns - values) / Var_m(returns)`` over the trained tokens (population
    variances); NaN when the returns do not vary (nothing to explain)."""
    m = mask > 0
    ret, val = returns[m].double(), values[m].double()
    var = ret.var(unbiased=False) if ret.numel() else torch.tensor(0.0, dtype=torch.float64)
    if float(var) == 0.0:
        return float("nan")
    return float(1.0 - (ret - val).var(unbiased=False) / var)


def ppo_batch(
    batch: StepBatch,
    rewards: torch.Tensor,
    values: torch.Tensor,
    *,
    gamma: float,
    lambd: float,
    normalize_advantages: bool,
    kl_coef: float = 0.0,
    old_log_probs: Optional[torch.Tensor] = None,
    ref_log_probs: Optional[torch.Tensor] = None,
) -> Tuple[StepBatch, Dict[str, float]]:
    """``batch`` (a rollout's, advantages unset or ignored) with PPO's ``advantages``, the critic's
    old ``values`` and the GAE ``returns`` (all ``[sum R_i]`` fp32), and the driver's ``critic/*``
    metrics of the rollout (``explained_variance``, ``returns_mean``)."""
    lengths, mask = batch.response_lengths, batch.loss_mask.float()
    r = token_level_rewards(rewards, lengths, mask, kl_coef, old_log_probs, ref_log_probs)
    v = values.detach().float().cpu()
    adv_p, ret_p = loss_core.gae(to_padded(r, lengths), to_padded(v, lengths), to_padded(mask, lengths), gamma, lambd)
    adv, ret = from_padded(adv_p, lengths), from_padded(ret_p, lengths)
    if normalize_advantages:
        adv = masked_whiten(adv, mask)
    trained = mask > 0
    stats = {
        "critic/explained_variance": explained_variance(ret, v, mask),
        "critic/returns_mean": float(ret[trained].double().mean()) if bool(trained.any()) else 0.0,
    }
    if kl_coef > 0:
        kl = (old_log_probs.double() - ref_log_probs.double())[trained]
        stats["critic/kl_penalty_mean"] = float(kl.mean()) if kl.numel() else 0.0
    out = replace(batch, advantages=adv.float(), values=v, returns=ret.float())
    return out.validate(), stats
