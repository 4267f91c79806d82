"""The rollout manager as a Ray actor (the logic lives in ``rl_plugin.rollout.manager``)."""

from __future__ import annotations

import ray

from rl_plugin.ray.engine_actor import create_engines
from rl_plugin.rollout.manager import RolloutManager


def create_rollout_manager(args, placement, checkpoint_dir: str, train_data: str, eval_data):
    """The engine actors (if any, see ``rl_plugin.ray.cluster.engine_processes``), then the
    manager that drives them. Returns ``(manager, engines)``."""
    engines = []
    try:
        engines = create_engines(args, placement, checkpoint_dir)
        opts = placement.rollout_options(args.rollout_num_gpus or args.rollout_num_gpus_per_engine)
        actor = ray.remote(RolloutManager).options(**opts, max_restarts=0).remote(args, checkpoint_dir, train_data, eval_data, engines or None)
        ray.get(actor.state_dict.remote())  # surface construction errors (engine, dataset, reward) here
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
        for e in engines:
            ray.kill(e, no_restart=True)
        raise RolloutSetupError(f"the rollout manager could not start: {error_line(exc)}") from None
    return actor, engines


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
