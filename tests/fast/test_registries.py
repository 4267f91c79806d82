"""The registries of rl_plugin (``rl_plugin.registries``): argparse ``choices`` are the registry
names, every lazy entry resolves, and the flag layer lists names without importing torch (the
``Registry`` class itself: ``test_registry_base.py``)."""

import argparse
import subprocess
import sys

import pytest

from rl_plugin import registries
from rl_plugin.arguments import build_parser
from rl_plugin.registry_base import RegistryError

# flag -> the registry its choices come from
FLAG_REGISTRY = {
    "--advantage-estimator": registries.ADVANTAGE_ESTIMATORS,
    "--loss-aggregation": registries.LOSS_AGGREGATIONS,
    "--kl-loss-type": registries.KL_ESTIMATORS,
    "--rm-type": registries.REWARDS,
    "--rollout-engine": registries.ROLLOUT_ENGINES,
    "--train-backend": registries.TRAIN_BACKENDS,
}


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return parser._option_string_actions[flag]


@pytest.mark.parametrize("flag", sorted(FLAG_REGISTRY))
def test_argparse_choices_are_the_registry_names(flag):
    assert tuple(_action(build_parser(), flag).choices) == FLAG_REGISTRY[flag].names()


def test_a_name_registered_before_the_parser_is_built_becomes_a_choice():
    registries.KL_ESTIMATORS.register("k_test_only", lambda d: d)
    try:
        assert "k_test_only" in _action(build_parser(), "--kl-loss-type").choices
    finally:
        del registries.KL_ESTIMATORS._entries["k_test_only"]


@pytest.mark.parametrize("name", sorted(registries.ALL))
def test_every_lazy_entry_resolves_to_a_callable(name):
    reg = registries.ALL[name]
    for entry in reg.names():
        assert callable(reg.get(entry)), f"{name}[{entry!r}]"


def test_the_loss_core_dispatches_through_the_registries():
    import torch

    from rl_plugin.loss import get_policy_loss, gspo_loss, kl_estimate, ppo_clip_loss
    from rl_plugin.loss.advantages import grpo_advantages
    from rl_plugin.loss.kl import low_var_kl

    assert get_policy_loss("ppo_clip") is ppo_clip_loss and get_policy_loss("gspo") is gspo_loss
    assert registries.ADVANTAGE_ESTIMATORS.get("gspo") is grpo_advantages  # GSPO changes the ratio, not A
    assert registries.KL_ESTIMATORS.get("low_var_kl") is low_var_kl
    with pytest.raises(
        RegistryError, match="--kl-loss-type 'k4': unknown KL estimator; choose from k1, k2, k3, low_var_kl"
    ):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


def _fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_flag_layer_lists_names_without_importing_torch():
    """``python -m rl_plugin.arguments`` stays cheap: building and validating the parser imports
    no torch (the registries hold 'module:attr' strings)."""
    code = (
        "import sys; from rl_plugin.arguments import parse_args; parse_args([]); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m == 'rl_plugin.loss' or m.startswith(('rl_plugin.loss.', 'rl_plugin.rollout'))))"
    )
    assert _fresh(code) == "[]"


def test_engine_interface_does_not_import_an_engine():
    """No import cycle: ``rollout/engines/base.py`` (the interface) never imports ``hf_engine``."""
    assert (
        _fresh(
            "import sys, rl_plugin.rollout.engines.base; print('rl_plugin.rollout.engines.hf_engine' in sys.modules)"
        )
        == "False"
    )
