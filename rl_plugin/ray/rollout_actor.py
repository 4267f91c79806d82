"""The rollout manager as a Ray actor (the logic lives in ``rl_plugin.rollout.manager``)."""

from __future__ import annotations

import ray

from rl_plugin.rollout.manager import RolloutManager


def create_rollout_manager(args, placement, checkpoint_dir: str, train_data: str, eval_data):
    opts = placement.rollout_options(args.rollout_num_gpus or 1)
    actor = ray.remote(RolloutManager).options(**opts, max_restarts=0).remote(args, checkpoint_dir, train_data, eval_data)
    try:
        ray.get(actor.state_dict.remote())  # surface construction errors (engine, dataset, reward) here
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
        raise RolloutSetupError(f"the rollout manager could not start: {error_line(exc)}") from None
    return actor


class RolloutSetupError(RuntimeError):
    """Bad rollout input (dataset, reward function, engine) found while the actor starts."""


def error_line(exc: Exception) -> str:
    """The ``SomeError: message`` line of a remote traceback (Ray wraps it in its own text)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and " " not in head:
            return ln
    return lines[-1] if lines else type(exc).__name__
