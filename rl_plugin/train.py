"""``rl-plugin-train`` / ``python -m rl_plugin.train``: the Ray-driven RL loop.

Per rollout k (``--num-rollout`` of them)::

    data  = rollout_manager.generate(k)          # prompts x n samples, rewards, sampler log-probs
    plans = steps.plan(data)                     # advantages over whole groups; steps; DP split
    train_group.train_rollout(plans)             # old/ref log-probs, then each optimizer step
    rollout_manager.update_weights(buckets)      # weight sync in place, bucket by bucket: the next rollout is on-policy
    [check weights] [save] [eval] [log]

With no ``--prompt-data`` it runs the embedded default (``rl_plugin.loop.embedded``). Resume:
``--load DIR`` restores model, optimizer, RNG and step (backend) plus the rollout id and dataset
position (loop state in the checkpoint's ``extra``). ``--save-interval N`` counts rollouts here
(one rollout = one or more optimizer steps), and a final checkpoint is written at the end.
"""

from __future__ import annotations

import sys
from typing import List, Optional

from rl_plugin.arguments import RLArgumentError
from rl_plugin.arguments.embedded import parse_train_flags


def parse_train_args(argv: Optional[List[str]] = None):
    return parse_train_flags(argv, prog="rl-plugin-train")


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = parse_train_args(argv)
    except RLArgumentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from rl_plugin.errors import Interrupted, LoopError
    from rl_plugin.loop.driver import Driver

    try:
        Driver(args, argv=sys.argv[1:] if argv is None else argv).run()
    except RLArgumentError as exc:  # a flag or file problem, found before Ray starts (or at --load)
        print(f"\nerror: {exc}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        print(f"\n{exc}", file=sys.stderr)
        return 130  # the shell's code for "ended by SIGINT"
    except LoopError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before the loop started: nothing was written
        print("\ninterrupted (Ctrl-C) before training started; nothing was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
