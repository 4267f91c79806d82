"""``make_critic_group`` (``rl_plugin.ray.critic_group``): no group without a critic. The group on
a real multi-node cluster (its actors on the critic's own bundles) is ``test_placement.py``."""

from __future__ import annotations

from rl_plugin.ray.cluster import Placement
from rl_plugin.ray.critic_group import make_critic_group
from tests.support.placement import placement_config


def test_no_critic_no_group():
    run = placement_config()  # grpo: the critic is off; nothing is asked of Ray (no placement group here)
    assert make_critic_group(run, Placement(None, 4, False, True, 0)) is None
