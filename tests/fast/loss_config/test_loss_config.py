"""``LossConfig`` (``rl_plugin.loss_config``): one flat config composed of its parts, built once from
the parsed flags (each part's fields read from its flags), re-exported by the loss core."""

from __future__ import annotations

from dataclasses import fields

from rl_plugin.arguments import parse_args
from rl_plugin.loss import LossConfig as CoreLossConfig
from rl_plugin.loss_config import PARTS, LossConfig
from rl_plugin.loss_config.policy import GROUP_RELATIVE


def _cfg(flags=""):
    return LossConfig.from_args(parse_args(flags.split()))


def test_the_config_is_its_parts_and_the_loss_cores():
    assert CoreLossConfig is LossConfig
    own = {f.name for f in fields(LossConfig)}
    for part in PARTS:
        assert {f.name for f in fields(part)} <= own, part.__name__
    assert own == {f.name for part in PARTS for f in fields(part)}  # nothing but its parts' fields
    assert LossConfig.GROUP_RELATIVE == GROUP_RELATIVE


def test_defaults_from_no_flags():
    cfg = _cfg()
    assert (cfg.loss_aggregation, cfg.policy_loss, cfg.loss_type, cfg.qkv_format, cfg.temperature) == (
        "sample_mean",
        "ppo_clip",
        "policy_loss",
        "thd",
        1.0,
    )
    assert (cfg.use_tis, cfg.use_opd, cfg.custom_pg_reducer, cfg.custom_tis_function, cfg.max_seq_len) == (
        False,
        False,
        None,
        None,
        None,
    )


def test_one_flag_of_each_part_reaches_its_field():
    cfg = _cfg(
        "--loss-aggregation constant --loss-aggregation-divisor 64 --advantage-estimator gspo --eps-clip 3e-4 "
        "--qkv-format bshd --seq-length 128 --use-tis --tis-level geometric --tis-clip-low 0.5 "
        "--use-opd --opd-teacher-load /t --opd-kl-coef 0.5"
    )
    assert (cfg.loss_aggregation, cfg.loss_aggregation_divisor) == ("constant", 64.0)
    assert (cfg.policy_loss, cfg.eps_clip) == ("gspo", 3e-4)
    assert (cfg.qkv_format, cfg.max_seq_len) == ("bshd", 128)
    assert (cfg.use_tis, cfg.tis_level, cfg.tis_clip_low, cfg.tis_clip) == (True, "geometric", 0.5, 2.0)
    assert (cfg.use_opd, cfg.opd_teacher_load, cfg.opd_kl_coef) == (True, "/t", 0.5)
    assert LossConfig.resolved_mode(parse_args(["--calculate-per-token-loss"])) == "token_mean"
