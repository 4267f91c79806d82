"""The driver's handle on the rollout side: the manager actor, its engines, retries and restarts
(beside ``train_group.py``, the handle on the train side).

``RolloutClient`` owns the rollout-manager actor and its engine actors. Every call goes through
it: a call that raises inside the manager (bad data, a reward function) ends the run with the
remote error line; a manager or engine that DIED (``RayActorError``) is replaced by a fresh one at
the dataset position of before the failed call, handed the trainer's current weights by a full
sync (``on_restart``), and the call is resubmitted: at most ``--max-rollout-retries`` times a run.
Generation is seeded by ``seed + k``, so a retried rollout yields the samples the first try would.

Its waits poll (``POLL_S``) and call ``poll(can_abandon)`` in between (the run's exit request,
``rl_plugin.loop.exit_request``): ``abort`` asks the manager, on its ``control`` thread, to abort
the rollout in progress (without waiting for the answer); a generate that ends aborted becomes
``StopRequested``.

It also keeps the manager's dataset position after the last generate (``dataset_state``), which
a checkpoint saves. The loop hands it what it reads of the run's settings (the engine's name for
messages, ``--max-rollout-retries``) and the resume hint its messages end with.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

import ray

from rl_plugin.errors import LoopError, StopRequested
from rl_plugin.ray.rollout_actor import create_rollout_manager, error_line, fault_points, generate_ref
from rl_plugin.rollout.sample import RolloutData

POLL_S = 0.2  # a wait's ray.wait timeout, between two calls of ``poll``
# Test hook: "1" makes ``abort`` occupy the manager's control thread with a call that never returns
# instead of the abort, as user code holding that thread would: the exit must not wait on it.
ABORT_HANGS_ENV = "RL_PLUGIN_FAULT_ABORT_HANGS"


def _never_answer(manager) -> None:
    threading.Event().wait()


def actor_died(exc: Exception) -> bool:
    """The rollout manager died (``RayActorError``), or one of its engine actors did while the
    manager waited on it (the manager's call then fails with the engine's ``RayActorError``)."""
    if isinstance(exc, ray.exceptions.RayActorError):
        return True
    return isinstance(getattr(exc, "cause", None), ray.exceptions.RayActorError)


class RolloutClient:
    def __init__(self, run, placement, resume_hint: Callable[[], str], *, hook_args):
        """``run``: the ``RunConfig``; ``hook_args``: the parsed flags, for the user's hooks only
        (slime's ``fn(args, ...)``; ``rl_plugin.configs.run``)."""
        self._run, self._hook_args, self.placement = run, hook_args, placement  # for the manager's constructor
        self.resume_hint = resume_hint
        # for restart and its messages
        self.rollout_engine, self.max_retries = run.rollout.engine.engine, run.fault_tolerance.max_rollout_retries
        self.on_restart: Callable[[], None] = lambda: None  # the driver's full weight sync into fresh engines
        self.on_fresh_engines: Callable[[], None] = lambda: None  # the weight ledger forgets the old engines
        self.manager, self.engines = self._create()
        self.restarts = 0  # dead rollout managers replaced so far (--max-rollout-retries)
        self.dataset_state = None  # the manager's dataset position before the next generate
        self.faults = fault_points()
        self.poll: Callable[[bool], None] = lambda can_abandon: None  # the run's exit request

    def _get(self, ref: ray.ObjectRef, can_abandon: bool):
        """``ray.get(ref)``, polling the run's exit request while it runs (module docstring)."""
        while not ray.wait([ref], timeout=POLL_S)[0]:
            self.poll(can_abandon)
        return ray.get(ref)

    def abort(self) -> Callable[[], Optional[str]]:
        """Ask the manager to abort the rollout in progress (an exit signal), without waiting: the
        exit's grace is for the checkpoint, and a manager whose control thread does not answer
        must not spend it. Returns what the manager was running, read when a message asks (None
        until it answered)."""
        if os.environ.get(ABORT_HANGS_ENV) == "1":  # the test hook: a control thread that never answers
            ref = self.manager.__ray_call__.options(concurrency_group="control").remote(_never_answer)
        else:
            ref = self.manager.abort.options(concurrency_group="control").remote()

        def running() -> Optional[str]:
            if not ray.wait([ref], timeout=0)[0]:
                return None
            what = ray.get(ref)
            return f"{what} in the rollout manager" if what else None

        return running

    def _create(self):
        return create_rollout_manager(self._run, self.placement, hook_args=self._hook_args)

    # -- calls ------------------------------------------------------------------------------------
    def call(self, method: str, *args):
        """A manager call; its failure (a raised error or a dead actor) ends the run with the
        remote error line instead of a Ray traceback."""
        try:
            return ray.get(getattr(self.manager, method).remote(*args))
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            raise LoopError(
                f"rollout manager failed during {method}: {error_line(exc)}. {self.resume_hint()}"
            ) from None

    def engine_node_ids(self) -> Sequence[str]:
        return self.call("engine_node_ids")

    def load_state_dict(self, state) -> None:
        """A checkpoint's data position (the manager's ``state_dict`` form) into the manager."""
        self.call("load_state_dict", state)

    def read_dataset_state(self) -> None:
        """The manager's dataset position now (before the run's first generate)."""
        self.dataset_state = self.call("state_dict")

    def submit_generate(self, k: int, handle) -> ray.ObjectRef:
        """Rollout k from the manager's source (generated; fully async: taken from its buffer), the
        weight sync ``handle`` (or None) loaded first."""
        return generate_ref(self.manager, k, self.faults, handle)

    def submit_evaluate(self, k: int, handle) -> ray.ObjectRef:
        """The eval after rollout k, the weight sync ``handle`` (or None) loaded first."""
        return self.manager.evaluate.remote(k, handle)

    def submit_update(self, handle_ref, version: Optional[int] = None) -> ray.ObjectRef:
        """A weight load of its own (``handle_ref``: a handle or its ObjectRef); ``version``: the
        trainer weight version it holds (what fully async labels the next tokens with)."""
        return self.manager.update_weights.remote(handle_ref, version)

    def wait_update(self, update: ray.ObjectRef) -> Optional[Dict[str, Any]]:
        """The manager's answer to a weight load (bytes, the slowest engine's seconds); None when
        it died and was replaced (the fresh manager and engines were synced by the restart)."""
        try:
            return self._get(update, can_abandon=False)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            if not actor_died(exc):
                raise LoopError(
                    f"weight sync failed (rollout update): {error_line(exc)}. {self.resume_hint()}"
                ) from None
            self.restart("update_weights", exc)
            return None

    def answered(self, data: RolloutData) -> RolloutData:
        """A generate's answer: its dataset position kept (no state_dict round trip)."""
        self.dataset_state = data.dataset_state
        return data

    def retrying(self, method: str, k: int, submit: Callable[[], ray.ObjectRef], first: Optional[ray.ObjectRef] = None):
        """``ray.get(submit())`` (or of ``first``, a call already in flight), resubmitted to a fresh
        rollout manager when the actor died; an error raised inside the call ends the run at once."""
        ref = first
        while True:
            try:
                return self._get(submit() if ref is None else ref, can_abandon=True)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                line = error_line(exc)
                if "GenerationAborted: " in line:  # the abort of an exit signal
                    raise StopRequested(
                        f"{method} of rollout {k} was {line.split('GenerationAborted: ', 1)[1]}"
                    ) from None
                if not actor_died(exc):
                    raise LoopError(
                        f"rollout manager failed during {method}: {error_line(exc)}. {self.resume_hint()}"
                    ) from None
                ref = None
                self.restart(f"{method} (rollout {k})", exc)

    # -- restart and teardown -----------------------------------------------------------------------
    def restart(self, during: str, exc: Exception) -> None:
        """Replace a dead rollout manager: a fresh actor at the dataset position of before the
        failed call, loaded with the trainer's current weights. At most --max-rollout-retries
        times per run; then the run stops naming the engine, the cause and --load."""
        cause = error_line(exc)
        engine = (
            f"the rollout engine ({self.rollout_engine}, in the rollout manager actor)"
            if not self.engines
            else f"a rollout engine ({self.rollout_engine}, one of {len(self.engines)} engine actors) or its manager"
        )
        if self.restarts >= self.max_retries:
            raise LoopError(
                f"{engine} died during {during}: {cause}. It was restarted {self.restarts} time(s) already "
                f"(--max-rollout-retries {self.max_retries}). {self.resume_hint()}"
            )
        self.restarts += 1
        print(
            f"{engine} died during {during}: {cause}; restarting it and retrying "
            f"({self.restarts}/{self.max_retries}, --max-rollout-retries)",
            flush=True,
        )
        self.kill()
        self.manager, self.engines = self._create()
        # the fresh engines hold the checkpoint's weights: a full sync of the trainer's current ones
        self.on_fresh_engines()
        self.call("load_state_dict", self.dataset_state)
        self.on_restart()

    def kill(self) -> None:
        actors: List[Any] = [self.manager, *self.engines]
        for actor in actors:
            ray.kill(actor, no_restart=True)
