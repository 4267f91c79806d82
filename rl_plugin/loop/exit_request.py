"""Stopping a run on purpose: exit signals and a wall-time budget (Megatron-LM's flags).

``--exit-signal-handler`` (default on): SIGTERM (what Slurm and Kubernetes send on preemption),
SIGUSR1 (Slurm's ``--signal`` default) and SIGHUP set a request; the loop finishes the train call
in progress (the rollout's optimizer steps), writes a checkpoint when ``--save`` is set, prints the
last checkpoint and the exact resume command, tears Ray down, releases the output lock and exits
with 128 + the signal. A second signal aborts at once (``Interrupted``): the last complete
checkpoint stays the resume point (a save cut short leaves only a ``.partial``, never loaded).

``--exit-duration-in-mins M``: once M minutes have passed since the run started, the loop saves
and stops the same way between two rollouts, and exits 0 (as Megatron-LM does), so a job chain
can resume it with the printed command.
"""

from __future__ import annotations

import signal
import sys
import time
from typing import Dict, Optional

from rl_plugin.errors import EXIT_SIGNALS, Interrupted


class ExitRequest:
    def __init__(self, *, handle_signals: bool, duration_mins: Optional[float], will_save: bool):
        self.handle_signals = handle_signals
        self.deadline = None if duration_mins is None else time.monotonic() + 60.0 * duration_mins
        self.duration_mins = duration_mins
        self.will_save = will_save
        self.signum: Optional[int] = None
        self._previous: Dict[int, object] = {}

    def install(self) -> None:
        """Take over the exit signals (again after ``ray.init``, which sets its own SIGTERM handler)."""
        if not self.handle_signals:
            return
        for sig in EXIT_SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            raise Interrupted(f"aborted by a second signal ({name})", exit_code=128 + signum)
        self.signum = signum
        then = "writing a checkpoint, then exiting" if self.will_save else "exiting (no --save: nothing is written)"
        print(
            f"\nreceived {name}: finishing the optimizer steps in progress, then {then}; a second signal aborts at once",
            file=sys.stderr,
            flush=True,
        )

    def reason(self) -> Optional[str]:
        """Why the loop must stop now (None: go on)."""
        if self.signum is not None:
            return f"stopped by {signal.Signals(self.signum).name}"
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return f"stopped after --exit-duration-in-mins {self.duration_mins:g}"
        return None

    def exit_code(self) -> int:
        return 128 + self.signum if self.signum is not None else 0
