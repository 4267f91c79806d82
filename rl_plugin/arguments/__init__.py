"""Every flag of rl_plugin, grouped by concern, with its validation beside it.

- ``add_rl_arguments(parser) -> parser``: adds the RL flags. Works on our own parser and as
  Megatron-LM's ``extra_args_provider`` (flags Megatron-LM already defines are not redefined).
- ``validate_rl_args(args)``: phase 1, static checks; raises ``RLArgumentError`` naming the flags,
  the rule and the fix; then writes the derived settings once (``--calculate-per-token-loss`` <=>
  ``--loss-aggregation token_mean``). The rules never write ``args``, so their order is free.
- ``validate_world(args, dp_size=...)``: phase 2, checks that need the world (DP size).
- ``build_parser()``: our standalone parser = Megatron-LM compat flags + RL flags.

A flag module is a file here with ``add_arguments(parser)`` and ``validate(args)`` (optionally
``validate_world(args, dp_size=...)``), listed in ``FLAG_MODULES`` (the order of the ``--help`` groups).
Each flag is defined once (``_util.add_flag`` raises on a second rl_plugin definition).
"""

from __future__ import annotations

import argparse
import importlib
from typing import List, Optional

from rl_plugin.arguments._util import RLArgumentError

FLAG_MODULES = (
    "training",
    "aggregation",
    "policy",
    "logprobs",
    "batching",
    "metrics",
    "fsdp_backend",
    "moe",
    "rollout",
    "rewards",
    "custom_rollout",
    "weight_sync",
    "off_policy",
    "routing_replay",
    "cluster",
    "logging",
    "checkpointing",
    "fault_tolerance",
    "async_training",
)


def _modules():
    return [importlib.import_module(f"rl_plugin.arguments.{name}") for name in FLAG_MODULES]


def add_rl_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for mod in _modules():
        mod.add_arguments(parser)
    return parser


def validate_rl_args(args: argparse.Namespace) -> argparse.Namespace:
    """Phase 1: every module's rules, then the derived settings, written once.

    A rule only reads the flags as given (a derived value it needs comes from a pure function such
    as ``aggregation.resolved_mode``), so the rules can run in any order and never see another
    rule's writes; ``aggregation.resolve`` then writes the one derived setting. Idempotent."""
    from rl_plugin.arguments import aggregation, megatron_compat

    megatron_compat.validate(args)  # ranges of the Megatron-LM flags we read (theirs or ours)
    for mod in _modules():
        mod.validate(args)
    aggregation.resolve(args)
    return args


def validate_world(args: argparse.Namespace, *, dp_size: int) -> None:
    for mod in _modules():
        check = getattr(mod, "validate_world", None)
        if check is not None:
            check(args, dp_size=dp_size)


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    from rl_plugin.arguments import megatron_compat

    parser = argparse.ArgumentParser(
        prog=prog, description="rl_plugin: RL post-training on Megatron-Core.", allow_abbrev=False
    )
    megatron_compat.add_arguments(parser)
    return add_rl_arguments(parser)


def parse_args(argv: Optional[List[str]] = None, *, validate: bool = True) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    return validate_rl_args(args) if validate else args


__all__ = [
    "FLAG_MODULES",
    "RLArgumentError",
    "add_rl_arguments",
    "build_parser",
    "parse_args",
    "validate_rl_args",
    "validate_world",
]
