"""The advantage estimators of ``rl_plugin.loss.advantages`` against their formulas."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.loss import compute_advantages
from tests.support.tolerance import FP64, tensor_within, within


def test_advantage_estimators():
    r = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 7.0], dtype=torch.float64)
    g = torch.tensor([0, 0, 0, 1, 1, 2])
    grpo = compute_advantages("grpo", r, g)
    m0, s0 = r[:3].mean(), r[:3].std()
    scale = float(r.abs().max() / s0)  # (r - mean) / std: terms of magnitude max|r| / std cancel
    assert tensor_within(grpo[:3], (r[:3] - m0) / (s0 + 1e-6), rtol=FP64, scale=scale)
    assert float(grpo[3:].abs().max()) == 0.0  # identical rewards / single sample -> 0
    assert torch.equal(compute_advantages("gspo", r, g), grpo)
    assert tensor_within(compute_advantages("dr_grpo", r, g)[:3], r[:3] - m0, rtol=FP64, scale=float(r.abs().max()))
    loo = compute_advantages("rloo", r, g)
    assert within(loo[0], r[0] - (r[1] + r[2]) / 2, rtol=FP64, scale=float(r.abs().max()))
    assert float(loo[5]) == 0.0  # a group of one has no leave-one-out baseline
    rpp = compute_advantages("reinforce_plus_plus_baseline", r, g, response_lengths=torch.tensor([2, 1, 1, 3, 1, 2]))
    w = torch.tensor([2, 1, 1, 3, 1, 2], dtype=torch.float64)
    assert within(
        float((rpp * w).sum() / w.sum()), 0.0, rtol=FP64, scale=float(rpp.abs().max())
    )  # whitened over tokens
    with pytest.raises(ValueError, match="sample 2: reward nan"):
        compute_advantages("grpo", torch.tensor([1.0, 0.0, float("nan")]), torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="--advantage-estimator"):
        compute_advantages("ppo", r, g)
