"""The off-policy part (``rl_plugin.loss_config.offpolicy``): the TIS band must hold rho = 1 (the
message says how much every gradient would be rescaled), the nucleus sampling and DeepSpeed rules,
and TIS settings without ``--use-tis`` named together."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.errors import RLArgumentError
from rl_plugin.loss_config import LossConfig


def _refused(flags):
    with pytest.raises(RLArgumentError) as err:
        parse_args(flags.split())
    return str(err.value)


@pytest.mark.parametrize(
    "flags, head, effect",
    [
        ("--tis-clip-low 1.5 --tis-clip 2", "--tis-mode truncate with the band [1.5, 2]", "grows at least 1.5-fold"),
        ("--tis-clip 0.8", "--tis-mode truncate with the band [0, 0.8]", "shrinks at least 1.25-fold"),
        ("--tis-mode mask --tis-clip-low 1 --tis-clip 2", "--tis-mode mask with the band [1.0, 2.0]", "are masked out"),
        ("--tis-clip-low 2 --tis-clip 2", "--tis-clip-low 2.0 with --tis-clip 2.0", "inverted or empty"),
        ("--tis-clip-low -0.5", "--tis-clip-low: the lower bound must be a finite number >= 0 (got -0.5)", ""),
    ],
)
def test_the_band_must_hold_one(flags, head, effect):
    message = _refused("--use-tis " + flags)
    assert message.startswith(head) and effect in message and "Fix:" in message


def test_nucleus_sampling_and_deepspeed_rules():
    assert _refused("--use-tis --rollout-top-p 0.9").startswith(
        "--use-tis with --rollout-top-p 0.9: the engine samples"
    )
    assert "not with --loss-aggregation token_mean" in _refused("--deepspeed-grad-scale --loss-aggregation token_mean")
    assert _refused("--deepspeed-metric-names --pg-metrics none").startswith(
        "--deepspeed-metric-names with --pg-metrics none"
    )
    assert _refused("--tis-level sequence --tis-mode mask").startswith("--tis-level, --tis-mode without --use-tis:")


def test_a_valid_band_reaches_the_config():
    cfg = LossConfig.from_args(
        parse_args("--use-tis --tis-mode mask --tis-clip-low 0.5 --tis-clip 2 --tis-level sequence".split())
    )
    assert (cfg.use_tis, cfg.tis_mode, cfg.tis_clip_low, cfg.tis_clip, cfg.tis_level) == (
        True,
        "mask",
        0.5,
        2.0,
        "sequence",
    )
