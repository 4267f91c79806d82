"""The distillation part (``rl_plugin.loss_config.opd``): its settings reach the config with
``--use-opd``, are named together without it, and the coefficient must be > 0."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.errors import RLArgumentError
from rl_plugin.loss_config import LossConfig
from rl_plugin.loss_config.opd import OPD_TYPES


def test_settings_reach_the_config():
    cfg = LossConfig.from_args(
        parse_args("--use-opd --opd-teacher-load /teacher --opd-type vllm --opd-kl-coef 0.25".split())
    )
    assert (cfg.use_opd, cfg.opd_teacher_load, cfg.opd_type, cfg.opd_kl_coef) == (True, "/teacher", "vllm", 0.25)
    assert (
        OPD_TYPES == ("megatron", "sglang", "vllm", "hf")
        and LossConfig.from_args(parse_args([])).opd_type == "megatron"
    )


def test_settings_without_use_opd_are_named_together():
    with pytest.raises(RLArgumentError) as err:
        parse_args("--opd-type hf --opd-kl-coef 2".split())
    assert str(err.value) == (
        "--opd-type, --opd-kl-coef without --use-opd: distillation is off, so these settings would be silently "
        "ignored. Fix: add --use-opd, or drop them."
    )


@pytest.mark.parametrize("coef", ["0", "-1"])
def test_the_coefficient_must_be_positive(coef):
    with pytest.raises(RLArgumentError, match=rf"--opd-kl-coef {float(coef)}: the coefficient must be > 0"):
        parse_args(f"--use-opd --opd-teacher-load d --opd-kl-coef {coef}".split())
