"""The hf engine's routing test hook (``--debug-engine-routing-flip``), in the routing replay section.

The routing replay flags themselves (R3 / R2, and the one mode the trainer runs) are declared on
``rl_plugin.configs.TrainConfig`` (``configs/routing_replay.py``).
"""

from __future__ import annotations

from rl_plugin.arguments._util import add_flag, fail


def add_arguments(parser):
    g = next(g for g in parser._action_groups if g.title == "routing replay")  # the declared flags' section
    add_flag(
        g,
        "--debug-engine-routing-flip",
        type=float,
        default=0.0,
        help=(
            "Test hook: the hf engine sends about this fraction of the tokens in every MoE layer to their top k-1 "
            "and (k+1)-th expert instead of the top k (as another kernel or a near tie flips a real engine's "
            "choice), so its routing disagrees with the trainer's on purpose; the mismatch/* metrics with and "
            "without --use-rollout-routing-replay then show what R3 removes. 0 (the default): off."
        ),
    )


def validate(args):
    flip = args.debug_engine_routing_flip
    if not 0.0 <= flip <= 1.0:
        fail(f"--debug-engine-routing-flip {flip}", "it is a fraction of tokens, in [0, 1]", "e.g. 0.3, or 0 (off)")
    if flip and args.rollout_engine != "hf":
        fail(
            f"--debug-engine-routing-flip with --rollout-engine {args.rollout_engine}",
            "the hook flips the hf engine's routers",
            "--rollout-engine hf",
        )
