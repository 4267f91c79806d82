"""Loss aggregation: each mode is a per-token weight w, built once per step, J = sum x * w.

Per-token loss x[i, t], mask m[i, t], M_i = sum_t m[i, t]; N samples, P prompt groups,
G_g = sum_{i in g} M_i; all counts GLOBAL for the step (``counts.StepCounts``):

    sample_mean  w = m / (N * M_i)          J = (1/N) sum_i [sum_t m x / M_i]          (GRPO)
    token_mean   w = m / sum_i M_i          J = sum_{i,t} m x / sum_i M_i              (DAPO)
    prompt_mean  w = m / (P * G_g(i))       J = (1/P) sum_g [sum_{i in g,t} m x / G_g] (ScaleRL)
    constant     w = m / (N * L)            J = (1/N) sum_i [sum_t m x / L]            (Dr.GRPO)

Fractional loss masks are supported exactly: m may be any finite value >= 0 (a soft token
weight, a mask scaled by an off-policy filter), and every denominator is the TRUE masked total,
so ``[.25, .25]`` over two tokens gives M_i = 0.5 and the sample still averages to its loss (a
constant loss c gives J = c in sample_mean, token_mean and prompt_mean for any positive mask).
Negative or non-finite mask values are refused (``BadBatchError`` naming the sample). Peers:
verl's ``masked_mean`` / ``agg_loss`` divide by the float mask sum as well; slime's
``sum_of_sample_mean`` clamps the denominator to 1, which halves a sample whose mask sums to 0.5.
A denominator that is exactly 0 (an empty sample, an all-masked group, an all-masked step) only
ever multiplies a zero mask, so it alone is replaced by 1: the term contributes 0, nothing is NaN.

A masked token never enters J: ``weighted_sum`` selects the tokens with w != 0 before
multiplying, so a non-finite per-token loss at a masked position (an overflowed ratio) cannot
turn 0 * inf into NaN.
Because the weights live on tokens, any slicing (micro-batches, CP chunks, DP shards) of x and w
together leaves sum x * w unchanged: that is the whole layout-invariance argument.

``aggregate`` is the single-process reference API over flat, concatenated responses.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from rl_plugin.loss.counts import StepCounts, check_loss_mask, counts_of, sample_token_counts
from rl_plugin.loss.segments import repeat_per_token
from rl_plugin.parallel import ParallelState
from rl_plugin.registries import LOSS_AGGREGATIONS
from rl_plugin.user_code import load_function

AGGREGATION_MODES = LOSS_AGGREGATIONS.names()

# One function per mode (registered by name in ``rl_plugin.registries.LOSS_AGGREGATIONS``):
# (mask m, global counts, per_token: [S] -> [sum R_i] repeat, group ids, divisor) -> w.


def sample_mean_weights(m, counts: StepCounts, per_token, group_ids, divisor):
    return per_token(1.0 / (float(counts.num_samples) * nonzero_or_one(counts.sample_tokens))).mul_(m)


def token_mean_weights(m, counts: StepCounts, per_token, group_ids, divisor):
    return m / (counts.total_tokens or 1.0)


def prompt_mean_weights(m, counts: StepCounts, per_token, group_ids, divisor):
    per_group = 1.0 / (counts.num_groups * nonzero_or_one(counts.group_tokens))
    return per_token(per_group[group_ids.long()]).mul_(m)


def constant_weights(m, counts: StepCounts, per_token, group_ids, divisor):
    if divisor is None or not math.isfinite(divisor) or divisor <= 0:
        raise ValueError(f"loss aggregation 'constant' needs a finite divisor > 0, got {divisor!r}")
    return m / (float(counts.num_samples) * float(divisor))


def nonzero_or_one(denominator: torch.Tensor) -> torch.Tensor:
    """The true masked totals, with exactly-0 entries (which only ever divide a zero mask) set to 1."""
    return torch.where(denominator != 0, denominator, torch.ones_like(denominator))


def weighted_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_t x_t w_t`` over the tokens with ``w_t != 0`` only: a zero weight never meets a
    non-finite ``x_t`` (0 * inf = NaN), and the gradient of ``x`` there is exactly 0."""
    w = w.to(device=x.device)
    return (torch.where(w != 0, x, torch.zeros((), dtype=x.dtype, device=x.device)) * w.to(x.dtype)).sum()


def token_weights(
    mode: str,
    counts: StepCounts,
    loss_mask: torch.Tensor,
    response_lengths: torch.Tensor,
    group_ids: torch.Tensor,
    divisor: Optional[float] = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Per-token weights ``[sum R_i]`` of this rank's samples for ``mode`` (``dtype``, float64 by default).

    Linear in tokens, no loop over samples: a per-sample factor is repeated over its tokens in
    one pass (``segments.repeat_per_token``) and multiplied by the mask."""
    weights_of = LOSS_AGGREGATIONS.get(mode)  # an unknown mode names --loss-aggregation and the choices
    m = loss_mask.detach().to(dtype)

    def per_token(per_sample: torch.Tensor) -> torch.Tensor:  # [S] float64 -> [sum R_i] dtype
        return repeat_per_token(per_sample.to(dtype), response_lengths, m.shape[0])

    return weights_of(m, counts, per_token, group_ids, divisor)


def aggregate(
    x: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths,
    mode: str,
    *,
    group_ids=None,
    divisor: Optional[float] = None,
) -> torch.Tensor:
    """J of one process's whole step: ``sum(x * w)`` with ``w = token_weights(mode, ...)``.

    ``x`` and ``loss_mask`` are flat over concatenated responses; ``group_ids`` (``[S]``) is
    needed for ``prompt_mean`` only (default: every sample its own group). ``loss_mask`` may be
    fractional (any finite value >= 0; module docstring): J normalises by the true masked totals.
    A non-finite ``x`` at a masked token (mask 0) does not reach J.
    """
    response_lengths = torch.as_tensor(response_lengths, dtype=torch.long)
    s = response_lengths.numel()
    if group_ids is not None:
        group_ids = torch.as_tensor(group_ids, dtype=torch.long)
    elif mode == "prompt_mean" or s == 0:
        group_ids = torch.arange(s)  # every sample its own group
    if x.shape[0] != int(response_lengths.sum()) or loss_mask.shape[0] != x.shape[0]:
        raise ValueError(
            f"x has {x.shape[0]} and loss_mask {loss_mask.shape[0]} tokens; response_lengths sum to "
            f"{int(response_lengths.sum())}"
        )
    check_loss_mask(loss_mask, response_lengths)
    if mode == "prompt_mean" or s == 0:
        counts = counts_of(loss_mask, response_lengths, group_ids, ParallelState.single())
    else:  # the other modes read only N and M_i (and their sum): no group bookkeeping
        m_i = sample_token_counts(loss_mask, response_lengths)
        counts = StepCounts(
            num_samples=s,
            total_tokens=float(m_i.sum()),
            num_groups=0,
            group_samples=m_i[:0],
            group_tokens=m_i[:0],
            sample_tokens=m_i,
        )
    w = token_weights(
        mode, counts, loss_mask, response_lengths, group_ids, divisor, dtype=torch.promote_types(x.dtype, torch.float32)
    )
    if x.dim() == 1 and x.dtype == w.dtype:
        j = torch.dot(x, w.to(x.device))  # the fast path; exact unless x is non-finite somewhere
        return j if bool(torch.isfinite(j)) else weighted_sum(x, w)
    return weighted_sum(x, w)


# --- custom reducer hook (miles-compatible) -------------------------------------------------

CustomReducerFactory = Callable[..., Callable[[torch.Tensor], torch.Tensor]]


def load_custom_reducer(path: str) -> CustomReducerFactory:
    """Import the factory (any form of ``rl_plugin.user_code.FORMS``)."""
    return load_function(path, "--custom-pg-loss-reducer-function-path")
