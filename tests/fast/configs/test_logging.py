"""The logging flags (``rl_plugin.configs.logging``): --use-wandb refused without the package, the
--log-interval range, the defaults."""

from __future__ import annotations

import importlib.util

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.configs.logging import LoggingConfig
from tests.support.flag_rules import assert_refused


def test_use_wandb_without_the_package_is_refused(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name == "wandb" else real(name, *a, **k)
    )
    assert_refused("--use-wandb", ["--use-wandb: the wandb package is not installed", "pip install 'rl-plugin[wandb]'"])


def test_use_wandb_with_the_package_passes(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: object() if name == "wandb" else real(name, *a, **k)
    )
    assert parse_args(["--use-wandb"]).use_wandb is True


@pytest.mark.parametrize("value", ["0", "-1"])
def test_log_interval_must_be_positive(value):
    assert_refused(f"--log-interval {value}", [f"--log-interval: must be >= 1 (got {value})", "--log-interval 1"])


def test_defaults():
    c = LoggingConfig()
    assert (c.output_dir, c.metrics_file, c.tensorboard_dir, c.use_wandb) == (None, None, None, False)
    assert (c.wandb_project, c.no_progress_bar, c.log_interval) == ("rl_plugin", False, 1)
