"""The rollout manager as a Ray actor (the logic lives in ``rl_plugin.rollout.manager``)."""

from __future__ import annotations

import os
import signal

import ray

from rl_plugin.ray.engine_actor import CONTROL_GROUP, create_engines
from rl_plugin.ray.testing_hooks import install_stale_engine
from rl_plugin.rollout.manager import RolloutManager


def create_rollout_manager(run, placement, *, hook_args):
    """The engine actors (if any, see ``rl_plugin.ray.cluster.engine_processes``), then the
    manager that drives them, with the run mode's rollout source (``rl_plugin.rollout.source``).
    Returns ``(manager, engines)``. The manager and the engines receive the run config's
    ``RolloutConfig``; ``hook_args`` (the parsed flags) travels to the manager only for the user's
    rollout hooks (slime's ``fn(args, ...)``)."""
    config, checkpoint_dir = run.rollout, run.train.model.hf_checkpoint
    engines = []
    try:
        engines = create_engines(config.engine, placement, checkpoint_dir)
        opts = placement.rollout_options(run.cluster.rollout_num_gpus or config.engine.tensor_parallel_size)
        actor = (
            ray.remote(concurrency_groups=CONTROL_GROUP)(RolloutManager)  # abort() while generate runs
            .options(**opts, max_restarts=0)
            .remote(
                config,
                checkpoint_dir,
                config.prompt_data,
                config.eval_prompt_data,
                engines or None,
                args=hook_args,
                threads=placement.threads.rollout,
                source=run.mode.source,
                async_settings=run.async_training,
            )
        )
        ray.get(actor.state_dict.remote())  # surface construction errors (engine, dataset, reward) here
        install_stale_engine(actor, engines)  # the tests' stale-engine double (ray/testing_hooks.py); else nothing
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


# Test hook: "K[,K...]" makes the driver SIGKILL the rollout actor's process right after sending
# it rollout K's generate call (once per listed K; list K twice to kill its retry too), to
# exercise the restart-and-retry path (``--max-rollout-retries``) with a real process death.
FAULT_ENV = "RL_PLUGIN_FAULT_KILL_ROLLOUT_AT"


def fault_points() -> list:
    spec = os.environ.get(FAULT_ENV, "")
    return [int(x) for x in spec.split(",") if x.strip()]


def generate_ref(actor, rollout_id: int, faults: list, handle=None):
    """``actor.generate.remote(rollout_id, handle)`` (``handle``: a weight sync to load first, or
    None); under the test hook, the actor's process is then SIGKILLed (what an OOM kill or a crashed
    engine looks like to the driver)."""
    pid = None
    if rollout_id in faults:
        faults.remove(rollout_id)
        pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))  # asked before the call queues
    ref = actor.generate.remote(rollout_id, handle)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    return ref
