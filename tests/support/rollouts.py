"""A random rollout of whole prompt groups as ``RolloutData`` (seeded): the input of the tests of
advantages and of step planning."""

from __future__ import annotations

import torch

from rl_plugin.rollout.sample import RolloutData


def random_rollout(num_groups: int = 3, n: int = 4) -> RolloutData:
    """``num_groups`` groups of ``n`` samples: responses of 1-4 tokens after 3 prompt tokens,
    rewards in [0, 1), sampler log-probs in (-1, 0]; generator seed 0."""
    g = torch.Generator().manual_seed(0)
    s = num_groups * n
    rl = torch.randint(1, 5, (s,), generator=g)
    tl = rl + 3
    return RolloutData(
        tokens=torch.randint(0, 16, (int(tl.sum()),), generator=g),
        total_lengths=tl,
        response_lengths=rl,
        rollout_log_probs=-torch.rand(int(rl.sum()), generator=g),
        rewards=torch.rand(s, generator=g),
        group_ids=torch.arange(num_groups).repeat_interleave(n),
        num_groups=num_groups,
    )
