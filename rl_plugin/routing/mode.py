"""The one routing-replay mode a run's flags ask for (read by the flag checks and ``TrainConfig``)."""

from __future__ import annotations


def routing_replay_mode(args):
    """``"rollout"`` (R3, with or without R2), ``"old"`` (R2 alone) or None."""
    if args.use_rollout_routing_replay:
        return "rollout"
    if args.use_routing_replay:
        return "old"
    return None
