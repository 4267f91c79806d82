"""The errors rl_plugin raises on purpose, defined below every other module so that runtime code
(planning, rollout checks, the weight sync, the loop) and the command line share them without
importing each other.

- ``RLArgumentError``: a flag, file or input that would train the wrong objective or cannot run;
  the message names the flags, the rule and the fix (``fail``). ``rl-plugin-train`` exits 2.
- ``LoopError``: the run stopped after start-up; the message says why and how to resume (exit 1).
- ``WeightSyncError``: the rollout engines' weights differ from the trainer's (``--check-weight-sync``).
- ``Interrupted``: Ctrl-C ended the run at once; the message names the resume command (exit 130).
  (A second exit signal ends the process at once from its handler: ``loop/exit_request.py``.)
- ``StopRequested``: an exit signal cut the rollout in progress (a call aborted, stopped early or
  given up); the run catches it, saves the last complete rollout and raises ``Stopped``.
- ``Stopped``: the loop stopped early on purpose (an exit signal, ``--exit-duration-in-mins``) after
  saving; the message names the checkpoint and the resume command (exit 128 + the signal, or 0).
"""

from __future__ import annotations

import signal

# The signals that stop a run on purpose (``Stopped``; ``rl_plugin.loop.exit_request``): SIGTERM
# (preemption by Slurm or Kubernetes), SIGUSR1 (Slurm's --signal default), SIGHUP.
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


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


class Interrupted(LoopError):
    """Ctrl-C (SIGINT): the actors are torn down at once; the message names the resume command."""

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
