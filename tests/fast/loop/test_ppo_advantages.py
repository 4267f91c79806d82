"""PPO's per-token advantages over a rollout (``rl_plugin.loop.ppo_advantages``), against
independent per-sample references written here with Python loops (the module is vectorised)."""

from __future__ import annotations

import math

import pytest
import torch

from rl_plugin.loop.ppo_advantages import (
    explained_variance,
    from_padded,
    masked_whiten,
    to_padded,
    token_level_rewards,
)


def _case():
    lengths = torch.tensor([3, 5, 1, 4])
    mask = torch.tensor([1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0, 0], dtype=torch.float32)  # sample 1: masked middle
    rewards = torch.tensor([1.0, -0.5, 2.0, 0.25])
    return lengths, mask, rewards


def test_padding_round_trips_and_zeros_the_tail():
    lengths, _, _ = _case()
    flat = torch.arange(13, dtype=torch.float32) + 1
    padded = to_padded(flat, lengths)
    assert padded.shape == (4, 5)
    assert padded[0].tolist() == [1, 2, 3, 0, 0] and padded[2].tolist() == [9, 0, 0, 0, 0]
    assert torch.equal(from_padded(padded, lengths), flat)


def test_reward_on_the_last_trained_token_and_the_kl_penalty():
    lengths, mask, rewards = _case()
    old = torch.linspace(-2.0, -0.1, 13)
    ref = torch.linspace(-1.5, -0.3, 13)
    r = token_level_rewards(rewards, lengths, mask, kl_coef=0.1, old_log_probs=old, ref_log_probs=ref)
    expected = -0.1 * (old - ref)
    start = 0
    for i, n in enumerate(lengths.tolist()):  # reference: a loop over samples
        trained = [t for t in range(n) if mask[start + t] > 0]
        last = trained[-1] if trained else n - 1
        expected[start + last] += rewards[i]
        start += n
    assert torch.allclose(r, expected, atol=1e-7), (r, expected)
    # sample 3 ends with two masked (tool) tokens: its reward sits on its position 1, not 3
    assert r[9:13].tolist()[1] == pytest.approx(0.25 - 0.1 * float(old[10] - ref[10]), abs=1e-6)
    plain = token_level_rewards(rewards, lengths, mask)
    assert plain.sum().item() == pytest.approx(rewards.sum().item()) and int((plain != 0).sum()) == 4


def test_kl_penalty_needs_the_log_probs():
    lengths, mask, rewards = _case()
    with pytest.raises(ValueError, match="kl_coef > 0 needs the old and the reference log-probs"):
        token_level_rewards(rewards, lengths, mask, kl_coef=0.1)


def test_masked_whiten_uses_only_trained_tokens():
    _, mask, _ = _case()
    x = torch.randn(13, generator=torch.Generator().manual_seed(0))
    y = masked_whiten(x, mask)
    sel = [float(v) for v, m in zip(x, mask) if m > 0]
    mean = sum(sel) / len(sel)
    std = math.sqrt(sum((v - mean) ** 2 for v in sel) / (len(sel) - 1))
    ref = (x.double() - mean) / (std + 1e-8)
    assert torch.allclose(y.double(), ref, atol=1e-6)
    trained = y[mask > 0].double()
    assert abs(float(trained.mean())) < 1e-6 and abs(float(trained.std()) - 1.0) < 1e-6
    assert torch.equal(masked_whiten(x, torch.zeros(13)), x)  # nothing trained: unchanged


def test_explained_variance():
    _, mask, _ = _case()
    ret = torch.randn(13, generator=torch.Generator().manual_seed(1))
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    m = mask > 0
    assert explained_variance(ret, torch.full((13,), float(ret[m].mean())), mask) == pytest.approx(0.0, abs=1e-6)
    val = ret * 0.5
    r, v = ret[m].double(), val[m].double()
    ref = 1 - float(((r - v) - (r - v).mean()).pow(2).mean() / (r - r.mean()).pow(2).mean())
    assert explained_variance(ret, val, mask) == pytest.approx(ref, rel=1e-9)
    assert math.isnan(explained_variance(torch.ones(13), val, mask))  # constant returns: nothing to explain


def test_ppo_batch_runs_gae_per_sample_and_whitens_over_trained_tokens():
    from rl_plugin.loop.advantages import ppo_base_batch
    from rl_plugin.loop.ppo_advantages import ppo_batch
    from rl_plugin.loss import gae
    from tests.support.rollouts import random_rollout

    data = random_rollout()
    data.loss_mask[3] = 0.0  # a masked (tool) token inside sample 1's response
    base = ppo_base_batch(data)
    n = int(base.response_lengths.sum())
    values = torch.linspace(0.1, 0.9, n)
    batch, stats = ppo_batch(base, data.rewards, values, gamma=0.9, lambd=0.8, normalize_advantages=False)
    start, advs, rets = 0, [], []
    for i, length in enumerate(base.response_lengths.tolist()):  # reference: one sample at a time
        m = base.loss_mask[start : start + length]
        r = token_level_rewards(data.rewards[i : i + 1], torch.tensor([length]), m)
        a, ret = gae(r[None], values[start : start + length][None], m[None], 0.9, 0.8)
        advs.append(a[0])
        rets.append(ret[0])
        start += length
    assert torch.allclose(batch.advantages, torch.cat(advs), atol=1e-6)
    assert torch.allclose(batch.returns, torch.cat(rets), atol=1e-6)
    assert torch.equal(batch.values, values) and batch.old_log_probs is None
    assert stats["critic/explained_variance"] == explained_variance(batch.returns, values, base.loss_mask)
    whitened, _ = ppo_batch(base, data.rewards, values, gamma=0.9, lambd=0.8, normalize_advantages=True)
    assert torch.allclose(whitened.advantages, masked_whiten(batch.advantages, base.loss_mask), atol=1e-6)
