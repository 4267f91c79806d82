"""``rl_plugin.loss.advantages.gae`` against an independent reference: each row compressed to its
trained tokens, the textbook GAE recursion run on that short sequence, the result scattered back
(a masked position takes the advantage of the next trained token, 0 past the last)."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.loss.advantages import gae


def reference_gae(r, v, m, gamma, lam):
    adv = torch.zeros_like(r, dtype=torch.float64)
    for b in range(r.shape[0]):
        idx = [t for t in range(r.shape[1]) if m[b, t] == 1]
        a_c = [0.0] * len(idx)
        later = 0.0
        for k in reversed(range(len(idx))):
            v_next = float(v[b, idx[k + 1]]) if k + 1 < len(idx) else 0.0
            delta = float(r[b, idx[k]]) + gamma * v_next - float(v[b, idx[k]])
            later = delta + gamma * lam * later
            a_c[k] = later
        carried = 0.0
        pos = len(idx) - 1
        for t in reversed(range(r.shape[1])):
            if pos >= 0 and idx[pos] == t:
                carried = a_c[pos]
                pos -= 1
            adv[b, t] = carried
    return adv, adv + v.to(torch.float64)


def _masked_batch(seed, batch=6, length=23):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(batch, length, generator=g, dtype=torch.float64)
    v = torch.randn(batch, length, generator=g, dtype=torch.float64)
    m = torch.ones(batch, length, dtype=torch.float64)
    for b in range(batch):
        start = int(torch.randint(1, length - 6, (1,), generator=g))
        m[b, start : start + 1 + b % 4] = 0  # a tool turn in the middle
        m[b, length - b % 3 :] = 0  # a padded tail (none for b % 3 == 0)
    m[-1] = 0  # a sample with no trained token at all
    return r, v, m


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 1.0)])
def test_gae_equals_reference_with_masked_segments(gamma, lam):
    r, v, m = _masked_batch(seed=int(gamma * 100 + lam * 10))
    adv, ret = gae(r, v, m, gamma, lam)
    ref_adv, ref_ret = reference_gae(r, v, m, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-12, atol=1e-12)


def test_gae_closed_forms_without_masks():
    r, v, _ = _masked_batch(seed=3)
    m = torch.ones_like(r)
    adv, ret = gae(r, v, m, 1.0, 1.0)  # Monte-Carlo: A_t = sum_{k >= t} r_k - V_t
    mc = r.flip(1).cumsum(1).flip(1)
    torch.testing.assert_close(adv, mc - v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, mc, rtol=1e-12, atol=1e-12)
    adv0, _ = gae(r, v, m, 0.9, 0.0)  # lam = 0: the one-step TD error
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    torch.testing.assert_close(adv0, r + 0.9 * next_v - v, rtol=1e-12, atol=1e-12)


def test_outcome_reward_reaches_every_trained_token_and_skips_the_tool_turn():
    # one episode: 3 model tokens, 2 tool tokens, 2 model tokens; reward 1 on the last token
    m = torch.tensor([[1, 1, 1, 0, 0, 1, 1]], dtype=torch.float64)
    r = torch.zeros_like(m)
    r[0, -1] = 1.0
    r[0, 3] = 5.0  # on a tool token: no action took it, ignored
    v = torch.zeros_like(m)
    adv, ret = gae(r, v, m, 1.0, 1.0)
    assert adv.tolist() == [[1.0] * 7]
    assert ret.tolist() == [[1.0] * 7]
    adv, _ = gae(r, v, m, 0.5, 1.0)  # the tool span costs no discount: the first token is 4 trained steps back, not 6
    assert adv[0, m[0] == 1].tolist() == [0.0625, 0.125, 0.25, 0.5, 1.0]
    assert adv[0, 3:5].tolist() == [0.5, 0.5]  # the masked span carries the next trained token's term


def test_dtype_shape_and_argument_errors():
    r, v, m = _masked_batch(seed=5)
    adv, ret = gae(r.float(), v.float(), m, 0.99, 0.95)
    assert adv.dtype == ret.dtype == torch.float32 and adv.shape == r.shape
    with pytest.raises(ValueError, match=r"\[batch, response_len\]"):
        gae(r, v[:, :-1], m, 1.0, 1.0)
    with pytest.raises(ValueError, match="lam must be in"):
        gae(r, v, m, 1.0, 1.5)
