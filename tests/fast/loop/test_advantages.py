"""The rollout's training batch (``rl_plugin.loop.advantages.rollout_batch``): GRPO advantages
normalised within each prompt group over the whole rollout, on every response token."""

from __future__ import annotations

import torch

from rl_plugin.loop.advantages import rollout_batch
from tests.support.rollouts import random_rollout
from tests.support.tolerance import FP32_LOSS_CORE, tensor_within


def test_rollout_batch_advantages_over_whole_groups():
    data = random_rollout()
    b = rollout_batch(data, "grpo")
    per_sample = b.advantages[torch.cumsum(b.response_lengths, 0) - 1]  # last token of each sample
    for gid in range(3):
        r = data.rewards[data.group_ids == gid]
        ref = (r - r.mean()) / (r.std() + 1e-6)
        # fp32 (r - mean) / std in another reduction order: terms of magnitude max|r| / std cancel
        scale = float(r.abs().max() / (r.std() + 1e-6))
        assert tensor_within(per_sample[data.group_ids == gid], ref, rtol=FP32_LOSS_CORE, scale=scale), gid
