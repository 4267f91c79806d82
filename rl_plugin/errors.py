"""The errors rl_plugin raises on purpose, defined below every other module so that runtime code
(planning, rollout checks, the weight sync, the loop) and the command line share them without
importing each other.

- ``RLArgumentError``: a flag, file or input that would train the wrong objective or cannot run;
  the message names the flags, the rule and the fix (``fail``). ``rl-plugin-train`` exits 2.
- ``LoopError``: the run stopped after start-up; the message says why and how to resume (exit 1).
- ``WeightSyncError``: the rollout engines' weights differ from the trainer's (``--check-weight-sync``,
  ``--ci-test``); ``WeightVersionError``: an engine holds another sync version than the trainer's.
- ``CiCheckFailed``: a ``--ci-test`` check failed at a rollout (``rl_plugin.loop.ci_checks``); the
  message is one line naming the check, the rollout and the values (exit 1).
- ``Interrupted``: Ctrl-C ended the run at once under ``--no-exit-signal-handler``; the message
  names the resume command (exit 130). (With the handler, Ctrl-C stops the run as SIGTERM does,
  ``Stopped``; a second exit signal ends the process at once from its handler:
  ``loop/exit_request.py``.)
- ``StopRequested``: an exit signal cut the rollout in progress (a call aborted, stopped early or
  given up); the run catches it, saves the last complete rollout and raises ``Stopped``.
- ``Stopped``: the loop stopped early on purpose (an exit signal, ``--exit-duration-in-mins``) after
  saving; the message names the checkpoint and the resume command (exit 128 + the signal, or 0).
"""

from __future__ import annotations

import signal

# The signals that stop a run on purpose (``Stopped``; ``rl_plugin.loop.exit_request``): SIGTERM
# (preemption by Slurm or Kubernetes), SIGUSR1 (Slurm's --signal default), SIGHUP, and SIGINT
# (Ctrl-C: the run saves as on SIGTERM and exits 130).
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT)

# One request to stop often arrives as two copies of the same exit signal: GNU ``timeout`` sends it to
# its child and then to its whole process group (the child again), Slurm and Kubernetes signal
# every process of the job step / container, and a wrapper (a shell, ``srun``, ``torchrun``)
# forwards the copy it got. The copies land within milliseconds of each other (a loaded node:
# tens); taken as a second signal, the run exited at once with nothing saved. So the same signal
# again within this window is the same request; a second request by hand (Ctrl-C again, another
# ``kill``) comes after it, as the first signal's message says.
REPEAT_WINDOW_S = 1.0


class RLArgumentError(ValueError):
    """A flag combination that would train the wrong objective. The message names the flags,
    the rule and the fix."""


def fail(flags: str, rule: str, fix: str) -> None:
    """Raise ``RLArgumentError`` as ``"<flags>: <rule>. Fix: <fix>."``."""
    raise RLArgumentError(f"{flags}: {rule}. Fix: {fix}.")


class LoopError(RuntimeError):
    """The run stopped; the message says why and how to resume."""


class WeightSyncError(LoopError):
    """The weights an engine holds differ from the ones the trainer published."""


class WeightVersionError(WeightSyncError):
    """An engine holds another sync version than the one it was given to load (it did not load it)."""


class CiCheckFailed(LoopError):
    """A ``--ci-test`` check failed at a rollout; the message is one line naming the check, the
    rollout, the worst token and both values."""


class Interrupted(LoopError):
    """Ctrl-C (SIGINT) without the exit-signal handler: the actors are torn down at once; the
    message names the resume command."""

    def __init__(self, message: str, exit_code: int = 130):
        super().__init__(message)
        self.exit_code = exit_code  # 130: the shell's code for "ended by SIGINT"; 128 + N for signal N


class StopRequested(LoopError):
    """An exit signal cut the rollout in progress (``rl_plugin.loop.exit_request``): a generate
    aborted or given up (``stuck``: it did not answer the abort), or a train call that stopped
    before its next optimizer step after ``steps_done`` of its steps (then the trainer's weights
    are between two rollouts, which no checkpoint can hold)."""

    def __init__(self, message: str, *, stuck: bool = False, steps_done: int = 0):
        super().__init__(message)
        self.stuck, self.steps_done = stuck, steps_done


class Stopped(LoopError):
    """The loop stopped between rollouts as asked (an exit signal, ``--exit-duration-in-mins``),
    after writing a checkpoint when ``--save`` is set."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
