"""``rl_plugin.loss.value_loss`` against a per-sample reference written from the formula of each
``--loss-aggregation`` mode, values and gradients, on random inputs with masked middle segments."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.loss import value_loss


def _inputs(seed=0, batch=6, length=11):
    g = torch.Generator().manual_seed(seed)
    vpreds = torch.randn(batch, length, generator=g, dtype=torch.float64)
    returns = torch.randn(batch, length, generator=g, dtype=torch.float64)
    values = vpreds + 0.4 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    mask = torch.ones(batch, length, dtype=torch.float64)
    for b in range(batch):
        mask[b, 2 + b % 3 : 4 + b % 3] = 0  # a masked tool span
        mask[b, length - b % 4 :] = 0  # padding
    mask[2] = 0  # one sample with nothing trained
    return vpreds, returns, values, mask


def reference(vpreds, returns, values, mask, c, mode, group_ids, divisor):
    per_sample, tokens = [], []
    for b in range(vpreds.shape[0]):
        ls = []
        for t in range(vpreds.shape[1]):
            if mask[b, t] == 0:
                continue
            vp, ret, old = vpreds[b, t], returns[b, t], values[b, t]
            vc = old + torch.clamp(vp - old, -c, c)
            ls.append(0.5 * torch.maximum((vp - ret) ** 2, (vc - ret) ** 2))
        per_sample.append(ls)
        tokens += ls
    n = len(per_sample)
    if mode == "sample_mean":
        return sum(sum(ls) / len(ls) for ls in per_sample if ls) / n
    if mode == "token_mean":
        return sum(tokens) / len(tokens)
    if mode == "constant":
        return sum(sum(ls) for ls in per_sample) / (n * divisor)
    groups = {}
    for b, ls in enumerate(per_sample):
        groups.setdefault(int(group_ids[b]), []).extend(ls)
    return sum(sum(ls) / len(ls) for ls in groups.values() if ls) / len(groups)


@pytest.mark.parametrize("mode", ["sample_mean", "token_mean", "prompt_mean", "constant"])
def test_value_loss_and_gradient_equal_reference(mode):
    vpreds, returns, values, mask = _inputs(seed=7)
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2])
    a = vpreds.clone().requires_grad_(True)
    b = vpreds.clone().requires_grad_(True)
    loss, clipfrac = value_loss(a, returns, values, mask, 0.2, mode, group_ids=group_ids, divisor=16.0)
    ref = reference(b, returns, values, mask, 0.2, mode, group_ids, 16.0)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    assert float(a.grad[mask == 0].abs().max()) == 0.0  # a masked token gets no gradient


def test_clipfrac_counts_trained_tokens_where_the_clipped_error_is_larger():
    values = torch.zeros(1, 4, dtype=torch.float64)
    returns = torch.tensor([[1.0, 1.0, -1.0, 1.0]], dtype=torch.float64)
    vpreds = torch.tensor([[0.9, 0.1, 0.5, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    # token 0: clipped to 0.2, error 0.64 > 0.01 (counts); token 1: inside the range (no);
    # token 2: clipped to 0.2, error 1.44 < 2.25 (no); token 3: masked
    loss, clipfrac = value_loss(vpreds, returns, values, mask, 0.2, "token_mean")
    assert float(clipfrac) == pytest.approx(1 / 3, abs=1e-15)
    assert float(loss) == pytest.approx(0.5 * (0.64 + 0.81 + 2.25) / 3, abs=1e-12)


def test_value_loss_refuses_bad_shapes_and_clip():
    vpreds, returns, values, mask = _inputs()
    with pytest.raises(ValueError, match=r"\[batch, response_len\]"):
        value_loss(vpreds, returns[:, :-1], values, mask, 0.2, "sample_mean")
    with pytest.raises(ValueError, match="--value-clip"):
        value_loss(vpreds, returns, values, mask, 0.0, "sample_mean")


def test_clipfrac_ignores_rounding_inside_the_clip_range():
    """Inside the range v + (v' - v) is v' only up to rounding; a wide clip clips nothing."""
    vpreds, returns, values, mask = _inputs(seed=5, batch=16, length=32)
    loss, clipfrac = value_loss(vpreds, returns, values, mask, 1e6, "token_mean")
    assert float(clipfrac) == 0.0
    tight, _ = value_loss(vpreds, returns, values, mask, 1e-12, "token_mean")
    assert float(loss) == pytest.approx(float(value_loss(vpreds, returns, vpreds, mask, 1.0, "token_mean")[0]))
    assert float(tight) >= float(loss)  # max(unclipped, clipped) >= unclipped
