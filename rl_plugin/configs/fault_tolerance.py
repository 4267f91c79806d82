"""FaultToleranceConfig: how often the loop restarts a dead rollout engine before giving up, and how
it stops when asked to (exit signals, a wall-time budget: Megatron-LM's names)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Optional

from rl_plugin.errors import REPEAT_WINDOW_S, fail
from rl_plugin.flags import Declared, flag

GROUP = "fault tolerance"


@dataclass(frozen=True)
class FaultToleranceConfig(Declared):
    max_rollout_retries: int = flag(
        "--max-rollout-retries",
        type=int,
        default=3,
        group=GROUP,
        help=(
            "When the rollout engine's actor dies (a crashed or killed process, a lost node), restart it, load the "
            "current weights into it and retry the rollout, at most this many times per run; generation is seeded "
            "per rollout, so a retried rollout yields the same samples. Beyond it the run stops naming the engine, "
            "the cause and the --load command. 0 stops at the first death. Errors raised inside a rollout (a "
            "reward function, bad data) are never retried: they would fail again."
        ),
    )
    exit_signal_handler: bool = flag(
        "--exit-signal-handler",
        action=argparse.BooleanOptionalAction,
        default=True,
        group=GROUP,
        help=(
            "On SIGTERM (preemption by Slurm or Kubernetes), SIGUSR1 (Slurm's --signal default), SIGHUP or SIGINT "
            "(Ctrl-C), stop the train call before its next optimizer step and abort the generation in progress, write "
            "the checkpoint of the last complete rollout when --save is set, print the last checkpoint and the resume "
            "command, tear Ray down and exit with 128 + the signal (143, Ctrl-C 130), all within "
            "--exit-signal-grace-s; a second signal exits at once (the last complete checkpoint stays the resume "
            f"point). The same signal again within {REPEAT_WINDOW_S:g} s is the same request (GNU timeout, Slurm and Kubernetes "
            "signal the run and its process group). Default on (Megatron-LM's flag, which defaults to off there); "
            "--no-exit-signal-handler leaves the signals' default actions (Ctrl-C then ends the run at once, "
            "unsaved)."
        ),
    )
    exit_signal_grace_s: float = flag(
        "--exit-signal-grace-s",
        type=float,
        default=20.0,
        group=GROUP,
        help=(
            "Seconds from the first exit signal to the exit, whatever runs: a generate that has not answered the "
            "abort after a quarter of it (a generate hook or a reward that never returns) is given up, the rest is "
            "for the checkpoint and the teardown, and a run still alive at the end exits at once with 128 + the signal, the last complete checkpoint as the resume point. "
            "Keep it below the scheduler's notice (Kubernetes' terminationGracePeriodSeconds, 30 s by default; "
            "Slurm's KillWait) minus a few seconds."
        ),
    )
    exit_duration_in_mins: Optional[float] = flag(
        "--exit-duration-in-mins",
        type=float,
        default=None,
        group=GROUP,
        help=(
            "Megatron-LM's wall-time budget: once this many minutes have passed since the run started, save (with "
            "--save) and stop between two rollouts, printing the resume command; exit code 0. Leave headroom for one "
            "rollout and one save below the scheduler's limit."
        ),
    )

    def check(self, run) -> None:
        n = self.max_rollout_retries
        if n is None or n < 0:
            fail(
                "--max-rollout-retries",
                f"must be >= 0 (got {n})",
                "use 0 to stop at the first engine death, or a small count such as 3",
            )
        g = self.exit_signal_grace_s
        if g is None or not (math.isfinite(g) and g > 0):
            fail(
                "--exit-signal-grace-s",
                f"must be a positive number of seconds (got {g})",
                "pass the scheduler's notice minus a few seconds, e.g. --exit-signal-grace-s 20 for Kubernetes' 30 s",
            )
        m = self.exit_duration_in_mins
        if m is not None and not (math.isfinite(m) and m > 0):
            fail(
                "--exit-duration-in-mins",
                f"must be a positive number of minutes (got {m})",
                "pass the job's wall-time limit minus one rollout and one save, e.g. --exit-duration-in-mins 230",
            )
