"""Naive, loop-based reference objectives, written straight from docs/design.md's formulas.

Deliberately independent of ``rl_plugin.loss`` (no weights, no index tricks): one Python loop
per sample, one process, autograd for the gradients. The parity tests compare the vectorised,
distributed core against these.
"""

from __future__ import annotations

import math

import torch


def split(x, lengths):
    out, start = [], 0
    for n in lengths:
        out.append(x[start : start + n])
        start += n
    return out


def objective(x, mask, lengths, groups, mode, divisor=None):
    """J of docs/design.md's list for per-token loss x over flat concatenated responses."""
    xs, ms = split(x, lengths), split(mask.to(x.dtype), lengths)
    n = len(lengths)
    if mode == "sample_mean":
        return sum((xi * mi).sum() / (float(mi.sum()) or 1.0) for xi, mi in zip(xs, ms)) / n
    if mode == "token_mean":
        total = sum(float(mi.sum()) for mi in ms)
        return sum((xi * mi).sum() for xi, mi in zip(xs, ms)) / (total or 1.0)
    if mode == "constant":
        return sum((xi * mi).sum() / divisor for xi, mi in zip(xs, ms)) / n
    if mode == "prompt_mean":
        ids = sorted(set(int(g) for g in groups))
        total = 0.0
        for g in ids:
            members = [i for i in range(n) if int(groups[i]) == g]
            tokens = sum(float(ms[i].sum()) for i in members)
            total = total + sum((xs[i] * ms[i]).sum() for i in members) / (tokens or 1.0)
        return total / len(ids)
    raise ValueError(mode)


def ppo_tokens(logp, old, adv, eps, eps_high, c):
    out = []
    for lp, o, a in zip(logp, old, adv):
        r = torch.exp(lp - o)
        l1 = -a * r
        l2 = -a * torch.clamp(r, 1 - eps, 1 + eps_high)
        term = torch.maximum(l1, l2)
        if c is not None and float(a) < 0:
            term = torch.minimum(term, -a * c)
        out.append(term)
    return torch.stack(out) if out else logp.new_zeros(0)


def gspo_tokens(logp, old, adv, mask, lengths, eps, eps_high):
    pieces = []
    for lp, o, a, m in zip(
        split(logp, lengths), split(old, lengths), split(adv, lengths), split(mask.to(logp.dtype), lengths)
    ):
        if lp.numel() == 0:
            continue
        s = torch.exp((m * (lp - o)).sum() / max(float(m.sum()), 1.0))
        l1 = -a * s
        l2 = -a * torch.clamp(s, 1 - eps, 1 + eps_high)
        pieces.append(torch.maximum(l1, l2))
    return torch.cat(pieces) if pieces else logp.new_zeros(0)


def low_var_kl(logp, ref):
    d = (logp - ref).clamp(-20, 20)
    return (torch.exp(-d) - 1 + d).clamp(-10, 10)


def log_softmax_entropy(logits, targets, temperature=1.0):
    z = logits.to(torch.float64) / temperature
    logp_all = torch.log_softmax(z, -1)
    logp = logp_all.gather(1, targets.unsqueeze(1)).squeeze(1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


def isclose(a, b, tol):
    return math.isclose(float(a), float(b), rel_tol=tol, abs_tol=tol)


def tis_weights(old, rollout, mask, lengths, level, mode, low, high):
    """Per-token off-policy weights, one sample at a time (docs/design.md "Off-policy data")."""
    out = []
    for o, r, m in zip(split(old, lengths), split(rollout, lengths), split(mask.to(torch.float64), lengths)):
        d = (o.double() - r.double()) * m
        if level == "token":
            rho = [math.exp(float(x)) for x in d]
        else:
            s = float(d.sum())
            if level == "geometric":
                s = s / max(float(m.sum()), 1.0)
            rho = [math.exp(s)] * len(d)
        for x in rho:
            if mode == "truncate":
                out.append(min(max(x, low), high))
            else:
                out.append(x if low <= x <= high else 0.0)
    return torch.tensor(out, dtype=torch.float64)
