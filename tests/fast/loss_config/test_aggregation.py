"""The aggregation part (``rl_plugin.loss_config.aggregation``): the mode resolved once from
``--loss-aggregation`` and Megatron-LM's ``--calculate-per-token-loss`` (a pure function of the
flags), its per-token name, and the custom reducer loaded when the config is built. (The rules'
messages: ``tests/fast/arguments/test_arguments.py``.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.errors import RLArgumentError
from rl_plugin.loss_config import LossConfig
from rl_plugin.loss_config.aggregation import DEFAULT_MODE, resolved_mode
from tests.fast.parity.test_loss_layouts import custom_sample_mean


@pytest.mark.parametrize(
    "explicit, per_token, mode",
    [
        (None, False, "sample_mean"),
        (None, True, "token_mean"),
        ("prompt_mean", False, "prompt_mean"),
        ("token_mean", True, "token_mean"),
    ],
)
def test_resolved_mode(explicit, per_token, mode):
    assert resolved_mode(SimpleNamespace(loss_aggregation=explicit, calculate_per_token_loss=per_token)) == mode
    assert DEFAULT_MODE == "sample_mean"


def test_calculate_per_token_loss_is_the_token_mean_mode():
    assert LossConfig(loss_aggregation="token_mean").calculate_per_token_loss
    assert not LossConfig(loss_aggregation="prompt_mean").calculate_per_token_loss
    assert LossConfig.from_args(parse_args(["--calculate-per-token-loss"])).loss_aggregation == "token_mean"


def test_the_custom_reducer_is_loaded_when_the_config_is_built():
    spec = "tests.fast.parity.test_loss_layouts:custom_sample_mean"
    cfg = LossConfig.from_args(parse_args(["--custom-pg-loss-reducer-function-path", spec]))
    assert cfg.custom_pg_reducer is custom_sample_mean and cfg.loss_aggregation == "sample_mean"
    with pytest.raises(
        RLArgumentError, match="--custom-pg-loss-reducer-function-path with --loss-aggregation constant"
    ):
        parse_args(
            [
                "--custom-pg-loss-reducer-function-path",
                spec,
                "--loss-aggregation",
                "constant",
                "--loss-aggregation-divisor",
                "8",
            ]
        )
