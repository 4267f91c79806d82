"""PPO's critic as a train group of its own (``--advantage-estimator ppo``, issue 47).

The critic is a ``TrainGroup`` of ``TrainActor``s like the actor's, built from the critic's
``TrainConfig`` (``run.critic_train``: the actor's with ``value_head=True``) on the critic's
bundles of the run's placement group (``Placement.for_critic()``: its own bundles, or the actor's
with ``--colocate``; ``rl_plugin.ray.cluster`` reserves them). Its ranks form their own
``torch.distributed`` world (rank 0's address is its own rendezvous), so the actor's and the
critic's collectives never mix.
"""

from __future__ import annotations

from typing import Optional

from rl_plugin.configs.run import RunConfig
from rl_plugin.ray.cluster import Placement
from rl_plugin.ray.train_group import TrainGroup


def make_critic_group(run: RunConfig, placement: Placement) -> Optional[TrainGroup]:
    """The critic's ``TrainGroup`` on ``placement``'s critic bundles, its ranks initialised with
    ``run.critic_train``; None when the run trains no critic."""
    if not run.critic.enabled:
        return None
    return TrainGroup(run.critic_train, placement.for_critic())
