"""``rl-plugin-train`` / ``python -m rl_plugin.train``: the Ray-driven RL loop.

Parses the flags (``rl_plugin.arguments``), then hands them to the run
(``rl_plugin.loop.run.TrainingRun``), which checks everything that needs no cluster, starts Ray and
has its schedule run one rollout after another (``--num-rollout``) over the rollout's pieces
(``rl_plugin.loop.rollout_pieces``)::

    data    = pieces.generate(k)             # the engines load the newest weights, then sample and score
    reports = pieces.train_rollout(data)     # advantages, the plan of steps, every optimizer step;
                                             # the ranks export and rank 0 publishes the new weights
    pieces.finish_rollout(k, ...)            # metrics rows, checkpoint and eval when due

(``--max-weight-staleness 1`` overlaps generate(k+1) with train(k): ``loop/overlapped_schedule.py``.)
With no ``--prompt-data`` it runs the embedded default (``rl_plugin.loop.embedded_setup``). ``--load DIR``
resumes model, optimizer, RNG, step, rollout id and dataset position (``rl_plugin.loop.resume``);
``--save-interval N`` counts rollouts, and a final checkpoint is written at the end.

Exit codes: 0 done (or stopped by ``--exit-duration-in-mins`` after saving); 2 a flag, file or
checkpoint problem found before training; 1 the run failed (the message names the resume command);
128 + N stopped by exit signal N (SIGTERM: 143, Ctrl-C: 130) after saving (``loop/exit_request.py``).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import List, Optional


def _exit_before_start(signum) -> None:
    """SIGTERM / SIGUSR1 / SIGHUP / SIGINT while the flags are parsed and checked: nothing started, nothing
    written; one line and 128 + N. The run routes the signals to its own handler (save, then stop)
    next (``rl_plugin.loop.exit_request``)."""
    os.write(2, f"\nstopped by {signal.Signals(signum).name} before training started; nothing was written\n".encode())
    os._exit(128 + signum)


def parse_train_args(argv: Optional[List[str]] = None):
    from rl_plugin.arguments.embedded import parse_train_flags

    return parse_train_flags(argv, prog="rl-plugin-train")


def main(argv: Optional[List[str]] = None) -> int:
    from rl_plugin.loop.exit_request import take_exit_signals

    previous = take_exit_signals(_exit_before_start)  # before any heavy import starts a thread (torch does)
    try:
        return _main(argv)
    finally:
        take_exit_signals(previous)


def _main(argv: Optional[List[str]]) -> int:
    from rl_plugin.arguments import RLArgumentError

    try:
        args = parse_train_args(argv)
    except RLArgumentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from rl_plugin.errors import Interrupted, LoopError, Stopped
    from rl_plugin.loop.run import TrainingRun

    try:
        TrainingRun(args, argv=sys.argv[1:] if argv is None else argv).run()
    except RLArgumentError as exc:  # a flag or file problem, found before Ray starts (or at --load)
        print(f"\nerror: {exc}", file=sys.stderr)
        return 2
    except (Interrupted, Stopped) as exc:
        print(f"\n{exc}", file=sys.stderr)
        return exc.exit_code  # 128 + N for signal N (Ctrl-C: 130), 0 after --exit-duration-in-mins
    except LoopError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C under --no-exit-signal-handler before the loop started
        print("\ninterrupted (Ctrl-C) before training started; nothing was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
