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
import time
from pathlib import Path
from typing import List, Optional

from rl_plugin.arguments import RLArgumentError, build_parser, validate_rl_args, validate_world


def parse_train_args(argv: Optional[List[str]] = None):
    from rl_plugin.loop.embedded import EMBEDDED_DEFAULTS

    parser = build_parser(prog="rl-plugin-train")
    first = parser.parse_args(argv)
    if first.prompt_data is None:  # the embedded default: its own defaults, explicit flags win
        parser.set_defaults(**EMBEDDED_DEFAULTS)
        first = parser.parse_args(argv)
    return validate_rl_args(first)


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = parse_train_args(argv)
    except RLArgumentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from rl_plugin.loop.driver import Driver, LoopError

    try:
        Driver(args).run()
    except RLArgumentError as exc:  # a flag problem found once paths or the world are known
        print(f"\nerror: {exc}", file=sys.stderr)
        return 2
    except LoopError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
