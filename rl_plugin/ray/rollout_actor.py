"""The rollout manager as a Ray actor (the logic lives in ``rl_plugin.rollout.manager``)."""

from __future__ import annotations

import ray

from rl_plugin.rollout.manager import RolloutManager


def create_rollout_manager(args, placement, checkpoint_dir: str, train_data: str, eval_data):
    opts = placement.rollout_options(args.rollout_num_gpus or 1)
    actor = ray.remote(RolloutManager).options(**opts, max_restarts=0).remote(args, checkpoint_dir, train_data, eval_data)
    ray.get(actor.state_dict.remote())  # surface construction errors (engine, dataset) here
    return actor
