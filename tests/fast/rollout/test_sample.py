"""The rollout sample types (``rl_plugin.rollout.sample``): ``Sample.prompt_length`` and
``get_reward_value`` (slime's accessor, ``--reward-key``), and ``RolloutData``: the default loss
mask, ``model_token_counts`` (the mask's per-sample sums), ``select_groups`` against a per-sample
reference, and the one-buffer pickle round trip."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import torch

from rl_plugin.rollout.sample import RolloutData, Sample


def test_prompt_length_and_the_reward_value():
    s = Sample(tokens=[1, 5, 6, 3, 7, 2], response_length=2, reward=0.5)
    assert s.prompt_length == 4
    assert s.get_reward_value(SimpleNamespace(reward_key=None)) == 0.5
    s.reward = {"reward": 1.0, "acc": 0.25}
    assert s.get_reward_value(SimpleNamespace()) == 1.0  # no --reward-key: "reward"
    assert s.get_reward_value(SimpleNamespace(reward_key="acc")) == 0.25
    assert Sample().status is Sample.Status.PENDING and Sample().metadata == {}
    assert Sample().metadata is not Sample().metadata  # one dict per sample


def _rollout(loss_mask=None, routed=False, teacher=False) -> RolloutData:
    """Three groups of two samples; sample i: ``T_i`` tokens, ``R_i`` response tokens."""
    tl = torch.tensor([4, 5, 3, 6, 4, 5])
    rl = torch.tensor([2, 3, 1, 2, 1, 3])
    n_tok, n_resp = int(tl.sum()), int(rl.sum())
    return RolloutData(
        tokens=torch.arange(n_tok),
        total_lengths=tl,
        response_lengths=rl,
        rollout_log_probs=-torch.arange(n_resp, dtype=torch.float32) / 10,
        rewards=torch.tensor([0.0, 1.0, 0.5, 0.25, 1.0, 0.0]),
        group_ids=torch.tensor([0, 0, 1, 1, 2, 2]),
        num_groups=3,
        loss_mask=loss_mask,
        routed_experts=torch.arange(n_tok * 2 * 2, dtype=torch.int16).view(n_tok, 2, 2) if routed else None,
        teacher_log_probs=-torch.arange(n_resp, dtype=torch.float32) if teacher else None,
    )


def test_the_default_loss_mask_trains_every_response_token():
    data = _rollout()
    assert torch.equal(data.loss_mask, torch.ones(12))
    assert data.loss_mask.dtype == torch.float32
    assert data.model_token_counts().tolist() == [2, 3, 1, 2, 1, 3]


def test_model_token_counts_are_the_masks_per_sample_sums():
    mask = torch.tensor([1, 0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 1], dtype=torch.float32)
    counts = _rollout(mask).model_token_counts()
    assert counts.dtype == torch.int64
    ref, at = [], 0
    for r in [2, 3, 1, 2, 1, 3]:
        ref.append(int(mask[at : at + r].sum()))
        at += r
    assert counts.tolist() == ref == [1, 2, 1, 0, 1, 2]


def test_select_groups_equals_the_per_sample_slices():
    mask = (torch.arange(12) % 3 != 0).float()
    data = _rollout(mask, routed=True, teacher=True)
    out = data.select_groups(torch.tensor([2, 0]), group_size=2)
    tok_starts = [0, 4, 9, 12, 18, 22]
    resp_starts = [0, 2, 5, 6, 8, 9]
    picked = [4, 5, 0, 1]
    tl, rl = data.total_lengths, data.response_lengths
    tokens = torch.cat([data.tokens[tok_starts[i] : tok_starts[i] + tl[i]] for i in picked])
    resp = torch.cat([torch.arange(resp_starts[i], resp_starts[i] + rl[i]) for i in picked])
    assert torch.equal(out.tokens, tokens)
    assert out.total_lengths.tolist() == [4, 5, 4, 5] and out.response_lengths.tolist() == [1, 3, 2, 3]
    assert torch.equal(out.rollout_log_probs, data.rollout_log_probs[resp])
    assert torch.equal(out.loss_mask, mask[resp])
    assert torch.equal(out.teacher_log_probs, data.teacher_log_probs[resp])
    assert torch.equal(out.routed_experts, data.routed_experts[tokens])  # tokens are their own indices here
    assert out.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert out.group_ids.tolist() == [0, 0, 1, 1] and out.num_groups == 2
    assert out.stats == {} and out.examples == []


def test_select_groups_without_routing_or_teacher_keeps_them_none():
    out = _rollout().select_groups(torch.tensor([1]), group_size=2)
    assert out.routed_experts is None and out.teacher_log_probs is None
    assert out.tokens.tolist() == list(range(9, 18))


def test_pickle_round_trip_keeps_every_field():
    data = _rollout(torch.tensor([1.0, 0.0] * 6), routed=True)
    data.stats = {"rollout/reward_mean": 0.5}
    data.dataset_state = {"train_dataset": {"epoch": 0, "offset": 3}}
    back = pickle.loads(pickle.dumps(data))
    for name in RolloutData.TENSOR_FIELDS:
        a, b = getattr(data, name), getattr(back, name)
        assert (a is None and b is None) or (torch.equal(a, b) and a.dtype == b.dtype), name
    assert back.stats == data.stats and back.dataset_state == data.dataset_state and back.num_groups == 3
