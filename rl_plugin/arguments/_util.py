"""Helpers shared by the flag modules: idempotent flag registration and the error type."""

from __future__ import annotations

from rl_plugin.errors import RLArgumentError, fail  # noqa: F401 - re-exported: the flag modules raise these


class DuplicateFlagError(ValueError):
    """rl_plugin defines a flag twice (a bug in ``rl_plugin.arguments``, not a user error)."""


OWNER = "rl_plugin_group"  # attribute on the argparse actions rl_plugin defines: the group's title


def has_flag(parser, flag: str) -> bool:
    """True if the parser (or argument group) defines ``flag``; argparse has no public lookup."""
    return flag in parser._option_string_actions


def add_flag(group, *names: str, **kwargs) -> None:
    """Add a flag unless a foreign parser already defines it (Megatron-LM's parser defines its
    own flags, e.g. ``--calculate-per-token-loss``; we read theirs instead of redefining them).
    A flag rl_plugin itself already defined raises ``DuplicateFlagError``: one definition per flag."""
    existing = [
        group._option_string_actions[n] for n in names if has_flag(group, n)
    ]  # a group shares its parser's table
    for action in existing:
        owner = getattr(action, OWNER, None)
        if owner is not None:
            raise DuplicateFlagError(
                f"{'/'.join(names)} is defined twice by rl_plugin: in the {owner!r} group and again in "
                f"{group.title!r}; keep one definition and read the flag from there"
            )
    if existing:
        return
    action = group.add_argument(*names, **kwargs)
    setattr(action, OWNER, group.title)
