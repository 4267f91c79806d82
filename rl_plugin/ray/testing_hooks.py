"""The environment variables tests use to reach into the train actors, read in one place.

Tests exercise the failure paths of a real run (a rank that dies mid-step, a preemption signal that
lands mid-train, the order of the colocation phases) by setting these in the driver's environment;
the train group hands them to its actors (``forwarded_env``: a Ray cluster started before the run
would not pass them on), and each actor reads them once when it starts (``TrainActorHooks``).
Outside tests none is set and the actor's check before a step is two ``None`` tests.

- ``RL_PLUGIN_FAULT_KILL_RANK_AT_STEP`` = "RANK:STEP": train rank RANK SIGKILLs itself when it is
  about to run optimizer step STEP (1-based): the driver's dead-actor report and ``--load`` resume.
- ``RL_PLUGIN_FAULT_SIGTERM_DRIVER_AT_STEP`` = "STEP": rank 0 sends SIGTERM to the driver (pid
  ``RL_PLUGIN_DRIVER_PID``, set by the train group, same node) when it is about to run step STEP,
  and waits for the stop request that follows, so the stop lands before that step as a preemption
  mid-train would.
- ``RL_PLUGIN_COLOCATION_TRACE`` = a file: the colocation phases appended there
  (``rl_plugin.phases``, read where each phase is recorded).
- ``RL_PLUGIN_FAULT_STALE_ENGINE_AT_SYNC`` = "V" or "V:weights": read by the driver when it starts
  a rollout manager (``install_stale_engine``): the first engine (the ``hf`` engine in the
  manager, else engine actor 0) gets a ``StaleReceiver``, which leaves it on its old weights at
  weight sync V. "V": it loads nothing and keeps its version (the weight-version check names it);
  "V:weights": it loads nothing but records version V, as a transport that lost the tensors would
  (the fingerprint check names it). For the ``--ci-test`` / ``--check-weight-sync`` tests.
- ``RL_PLUGIN_TRAIN_THREADS``: not a test hook, the train ranks' torch threads (``rl_plugin.threads``),
  forwarded with them for the same reason.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

from rl_plugin.phases import TRACE_ENV
from rl_plugin.threads import TRAIN_THREADS_ENV

FAULT_ENV = "RL_PLUGIN_FAULT_KILL_RANK_AT_STEP"
SIGNAL_ENV = "RL_PLUGIN_FAULT_SIGTERM_DRIVER_AT_STEP"
DRIVER_PID_ENV = "RL_PLUGIN_DRIVER_PID"
# the driver's variables the train group hands to its actors (``forwarded_env``)
FORWARDED_ENV = (FAULT_ENV, SIGNAL_ENV, TRAIN_THREADS_ENV, TRACE_ENV)
STOP_WAIT_S = 60.0  # how long rank 0 waits for the stop request after signalling the driver
STALE_ENGINE_ENV = "RL_PLUGIN_FAULT_STALE_ENGINE_AT_SYNC"


def forwarded_env(env: Mapping[str, str] = os.environ, driver_pid: Optional[int] = None) -> Dict[str, str]:
    """The variables of ``env`` the train actors receive; with the signal hook set, also the
    driver's pid (``driver_pid``, default this process) for rank 0 to signal."""
    out = {k: env[k] for k in FORWARDED_ENV if k in env}
    if SIGNAL_ENV in out:
        out[DRIVER_PID_ENV] = str(os.getpid() if driver_pid is None else driver_pid)
    return out


@dataclass(frozen=True)
class TrainActorHooks:
    """One train rank's test hooks, read once from its environment (module docstring)."""

    kill_at: Optional[Tuple[int, int]] = None  # (rank, step): that rank SIGKILLs itself before that step
    sigterm_driver_at: Optional[int] = None  # rank 0 signals the driver before this step
    driver_pid: Optional[int] = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "TrainActorHooks":
        kill = env.get(FAULT_ENV)
        at = env.get(SIGNAL_ENV)
        return cls(
            kill_at=tuple(int(x) for x in kill.split(":")) if kill else None,
            sigterm_driver_at=int(at) if at else None,
            driver_pid=int(env[DRIVER_PID_ENV]) if at and DRIVER_PID_ENV in env else None,
        )

    def before_step(self, rank: int, step: int, stop: threading.Event) -> None:
        """Called by train rank ``rank`` when it is about to run optimizer step ``step`` (1-based);
        ``stop`` is the actor's stop request, which the driver sets after the signal."""
        if self.kill_at == (rank, step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.sigterm_driver_at == step and rank == 0:
            if self.driver_pid is None:
                raise RuntimeError(f"{SIGNAL_ENV} is set but {DRIVER_PID_ENV} is not: start the run through TrainGroup")
            os.kill(self.driver_pid, signal.SIGTERM)
            stop.wait(timeout=STOP_WAIT_S)


class StaleReceiver:
    """Test double of an engine's ``WeightReceiver`` (``rl_plugin.weight_sync.receiver``): every
    sync but ``at`` passes through; at sync ``at`` it yields no bucket, so the engine keeps its old
    weights, and records the new version only when ``claim`` (a load that lost its tensors)."""

    def __init__(self, inner: Any, at: int, claim: bool):
        self.inner, self.at, self.claim = inner, at, claim

    @property
    def version(self) -> int:
        return self.inner.version

    def buckets(self, handle) -> Iterator[Dict[str, Any]]:
        if handle.version != self.at:
            yield from self.inner.buckets(handle)
            return
        if self.claim:
            self.inner.version = handle.version


def stale_engine_at(env: Mapping[str, str] = os.environ) -> Optional[Tuple[int, bool]]:
    """``(sync, claim)`` of ``STALE_ENGINE_ENV`` ("V" or "V:weights"), None when unset."""
    spec = env.get(STALE_ENGINE_ENV)
    if not spec:
        return None
    at, _, kind = spec.partition(":")
    if kind not in ("", "weights"):
        raise ValueError(f"{STALE_ENGINE_ENV}={spec!r}: expected 'V' or 'V:weights'")
    return int(at), kind == "weights"


def _stale_manager_engine(manager, at: int, claim: bool) -> None:
    manager.fleet.receiver = StaleReceiver(manager.fleet.receiver, at, claim)


def _stale_engine_actor(actor, at: int, claim: bool) -> None:
    actor.receiver = StaleReceiver(actor.receiver, at, claim)


def install_stale_engine(manager, engines) -> None:
    """Under ``STALE_ENGINE_ENV``: the first engine of a rollout manager just started (the Ray
    actor ``manager``, its engine actors ``engines``) gets a ``StaleReceiver``; else nothing."""
    hook = stale_engine_at()
    if hook is None:
        return
    import ray

    if engines:
        ray.get(engines[0].__ray_call__.remote(_stale_engine_actor, *hook))
    else:
        ray.get(manager.__ray_call__.remote(_stale_manager_engine, *hook))
