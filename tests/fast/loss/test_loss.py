"""``rl_plugin.loss``, the loss core's one public face (``tests/fast/test_layers.py``: outside the
core, nothing imports ``rl_plugin.loss.<module>``): every name it lists is importable from it and
is the object its own module defines, and the issue-47 critic functions are part of it."""

from __future__ import annotations

import importlib

import rl_plugin.loss as loss


def test_every_public_name_resolves_to_its_defining_object():
    assert sorted(loss.__all__) == sorted(set(loss.__all__))  # no name listed twice
    for name in loss.__all__:
        obj = getattr(loss, name)
        home = getattr(obj, "__module__", None)
        if home and home.startswith("rl_plugin.loss."):
            assert getattr(importlib.import_module(home), name) is obj, name


def test_the_critic_functions_are_public():
    from rl_plugin.loss.advantages import gae
    from rl_plugin.loss.value import value_loss

    assert loss.value_loss is value_loss
    assert "value_loss" in loss.__all__
    assert gae.__module__ == "rl_plugin.loss.gae"  # rl_plugin.loss.advantages.gae, as the contract names it
