"""The critic's part of a rollout (``--advantage-estimator ppo``), over the critic's train group.

The critic is a train group of its own (``TrainGroup`` built from ``run.critic_train``: the
actor's architecture with a scalar value head, its own optimizer and ranks). Per rollout::

    values   = critic.compute_values(rollout)           before any update ("old" values)
    old, ref = actor.log_probs(rollout)                 only with --kl-coef > 0, at the same time
    batch    = ppo_advantages.ppo_batch(...)            rewards per token, GAE, whitening
    actor steps on batch.advantages                     (none for the first --num-critic-only-steps rollouts)
    critic.train_values_rollout(the same step plan)     on (values, returns), after the actor's call

The forwards run on each group's DP shares (``dp_shares``) and come back in rollout order
(``gather_per_token``); the critic's forward and the actor's KL forwards are independent and run at
the same time (two groups of processes). The critic trains after the actor's train call returned
complete, so an exit signal that stops the actor's steps leaves both at the last complete rollout
(``TrainActor.train_values_rollout`` is never cut), and a checkpoint always holds the actor and the
critic of the same rollout. Rows: the critic's step reports join the actor's, step for step
(``merge_reports``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

from rl_plugin.cp import exclusive_cumsum, expand_runs
from rl_plugin.loop.ppo_advantages import ppo_batch
from rl_plugin.loss import StepBatch
from rl_plugin.ray.train_group import TrainGroup
from rl_plugin.step_plan import RankPlan, plan_global_batch_steps


def dp_shares(group: TrainGroup, batch: StepBatch) -> List[StepBatch]:
    """Each rank's share of ``batch`` for a forward: its DP rank's samples (CP / TP peers share)."""
    by_dp = plan_global_batch_steps(batch, global_batch_size=batch.num_samples, dp_size=group.dp_size)
    return [by_dp[group.dp_rank(r)].batch for r in range(group.world_size)]


def gather_per_token(
    group: TrainGroup, batch: StepBatch, shares: Sequence[StepBatch], answers: Sequence[torch.Tensor]
) -> torch.Tensor:
    """The ranks' per-token answers on their ``shares`` of ``batch``, as one ``[sum R_i]`` fp32
    tensor in ``batch``'s sample order (one rank per DP share; shares carry ``sample_index``)."""
    out = torch.empty(int(batch.response_lengths.sum()), dtype=torch.float32)
    starts = exclusive_cumsum(batch.response_lengths.long())
    ids, order = torch.sort(batch.sample_index.long())  # a share's sample -> its row in ``batch``
    seen = set()
    for r in range(group.world_size):
        d = group.dp_rank(r)
        if d in seen:
            continue
        seen.add(d)
        share = shares[r]
        rows = order[torch.searchsorted(ids, share.sample_index.long())]
        idx = expand_runs(starts[rows], share.response_lengths.long())
        out[idx] = answers[r].detach().float().cpu().reshape(-1)
    return out


def merge_reports(
    actor: List[Dict[str, Any]], critic: List[Dict[str, Any]], stats: Dict[str, float], samples: List[float]
) -> List[Dict[str, Any]]:
    """The rollout's rows: the actor's step reports, each with the critic's report of the same step
    and the rollout's ``stats`` (``critic/explained_variance``, ``critic/returns_mean``); with no
    actor step (a critic-only rollout), the critic's reports with each step's global ``samples``."""
    if not actor:
        return [{**rep, "samples": float(n), **stats} for rep, n in zip(critic, samples)]
    out = []
    for j, rep in enumerate(actor):
        extra = critic[j] if j < len(critic) else {}
        out.append({**rep, **extra, **stats})
    return out


def step_samples(group: TrainGroup, plans: Sequence[RankPlan]) -> List[float]:
    """Each planned step's samples over all DP ranks (one rank per DP share)."""
    first = {group.dp_rank(r): r for r in reversed(range(group.world_size))}
    steps = len(plans[0].step_bounds)
    return [
        float(sum(plans[r].step_bounds[j][1] - plans[r].step_bounds[j][0] for r in first.values()))
        for j in range(steps)
    ]


class CriticPieces:
    """``settings``: the run's ``CriticConfig`` (gamma, lambd, normalize_advantages, kl_coef,
    num_critic_only_steps, value_clip); ``critic``: the critic's train group; ``actor``: the actor's."""

    def __init__(self, settings, critic: TrainGroup, actor: TrainGroup):
        self.settings, self.critic, self.actor = settings, critic, actor

    def actor_trains(self, k: int) -> bool:
        """Whether the actor steps on rollout k (not during the first --num-critic-only-steps)."""
        return k >= self.settings.num_critic_only_steps

    def advantages(self, batch: StepBatch, rewards: torch.Tensor) -> Tuple[StepBatch, Dict[str, float]]:
        """``batch`` with PPO's advantages, values and returns; the driver's ``critic/*`` stats."""
        s = self.settings
        shares = dp_shares(self.critic, batch)
        values_call = self.critic.submit_compute_values(shares)
        old = ref = None
        if s.kl_coef > 0:  # the actor's forwards run while the critic's does
            actor_shares = dp_shares(self.actor, batch)
            old_call = self.actor.submit_log_probs(actor_shares, "actor")
            ref_call = self.actor.submit_log_probs(actor_shares, "ref")
            old = gather_per_token(self.actor, batch, actor_shares, old_call.wait())
            ref = gather_per_token(self.actor, batch, actor_shares, ref_call.wait())
        values = gather_per_token(self.critic, batch, shares, values_call.wait())
        return ppo_batch(
            batch,
            rewards,
            values,
            gamma=s.gamma,
            lambd=s.lambd,
            normalize_advantages=s.normalize_advantages,
            kl_coef=s.kl_coef,
            old_log_probs=old,
            ref_log_probs=ref,
        )

    def train(self, plans: Sequence[RankPlan]) -> List[Dict[str, Any]]:
        """The critic's value steps over ``plans`` (one per critic rank); rank 0's reports."""
        return self.critic.submit_train_values_rollout(plans, self.settings.value_clip).wait()[0]
