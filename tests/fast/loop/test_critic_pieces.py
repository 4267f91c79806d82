"""The critic's pieces of a rollout (``rl_plugin.loop.critic_pieces``) that need no actor: the DP
shares of a forward and their answers back in rollout order, the rows of a PPO rollout, and the
per-step sample counts. The calls on real train groups run in ``tests/fast/e2e/test_ppo_loop.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from rl_plugin.loop.advantages import ppo_base_batch
from rl_plugin.loop.critic_pieces import dp_shares, gather_per_token, merge_reports, step_samples
from rl_plugin.step_plan import plan_global_batch_steps
from tests.support.rollouts import random_rollout


@dataclass
class Layout:
    """A group's rank layout as ``TrainGroup`` answers it (``dp_rank`` of each rank)."""

    dp_ranks: List[int]

    @property
    def world_size(self) -> int:
        return len(self.dp_ranks)

    @property
    def dp_size(self) -> int:
        return len(set(self.dp_ranks))

    def dp_rank(self, rank: int) -> int:
        return self.dp_ranks[rank]


def test_a_forward_on_dp_shares_comes_back_in_rollout_order():
    batch = ppo_base_batch(random_rollout())
    target = torch.arange(int(batch.response_lengths.sum()), dtype=torch.float32) * 0.5  # a per-token answer
    offsets = torch.cumsum(batch.response_lengths, 0) - batch.response_lengths
    for layout in (Layout([0]), Layout([0, 1]), Layout([0, 0, 1, 1]), Layout([0, 1, 2])):  # DP x (TP/CP peers)
        shares = dp_shares(layout, batch)
        answers = []
        for share in shares:  # each rank answers its share's tokens: the target at the rollout's positions
            parts = [
                target[int(offsets[s]) : int(offsets[s]) + int(batch.response_lengths[s])] for s in share.sample_index
            ]
            answers.append(torch.cat(parts))
        assert torch.equal(gather_per_token(layout, batch, shares, answers), target), layout
        counts = [
            s.num_samples
            for r, s in enumerate(shares)
            if r == min(i for i in range(layout.world_size) if layout.dp_rank(i) == layout.dp_rank(r))
        ]
        assert sum(counts) == batch.num_samples


def test_rows_join_the_critic_to_the_actor_step_for_step():
    actor = [{"loss": 1.0, "samples": 8.0}, {"loss": 2.0, "samples": 8.0}]
    critic = [{"critic/value_loss": 0.5}, {"critic/value_loss": 0.25}]
    stats = {"critic/explained_variance": 0.1}
    rows = merge_reports(actor, critic, stats, [8.0, 8.0])
    assert rows == [
        {"loss": 1.0, "samples": 8.0, "critic/value_loss": 0.5, "critic/explained_variance": 0.1},
        {"loss": 2.0, "samples": 8.0, "critic/value_loss": 0.25, "critic/explained_variance": 0.1},
    ]
    # a critic-only rollout: the critic's reports, each with its step's global sample count
    only = merge_reports([], critic, stats, [8.0, 4.0])
    assert only == [
        {"critic/value_loss": 0.5, "samples": 8.0, "critic/explained_variance": 0.1},
        {"critic/value_loss": 0.25, "samples": 4.0, "critic/explained_variance": 0.1},
    ]


def test_step_samples_count_each_dp_share_once():
    batch = ppo_base_batch(random_rollout())
    layout = Layout([0, 0, 1, 1])  # 2 DP ranks, each with a TP / CP peer
    by_dp = plan_global_batch_steps(batch, global_batch_size=batch.num_samples // 2, dp_size=2)
    plans = [by_dp[layout.dp_rank(r)] for r in range(4)]
    assert step_samples(layout, plans) == [float(batch.num_samples // 2)] * 2
