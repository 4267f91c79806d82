"""The policy-loss part (``rl_plugin.loss_config.policy``): the estimator picks the loss, the
entropy is computed when the objective or the metrics need it, and the clip rules name the fix."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.errors import RLArgumentError
from rl_plugin.loss_config import LossConfig
from rl_plugin.loss_config.policy import GROUP_RELATIVE


def _cfg(*flags):
    return LossConfig.from_args(parse_args(list(flags)))


def test_the_estimator_picks_the_loss():
    for name in GROUP_RELATIVE:  # every built-in estimator
        assert _cfg("--advantage-estimator", name).policy_loss == ("gspo" if name == "gspo" else "ppo_clip")


def test_needs_entropy():
    assert not _cfg().needs_entropy
    assert _cfg("--entropy-coef", "0.01").needs_entropy and _cfg("--pg-metrics", "with_entropy").needs_entropy


def test_swapped_clip_bounds_name_the_swap():
    with pytest.raises(RLArgumentError) as err:
        parse_args(["--eps-clip", "0.3", "--eps-clip-high", "0.2"])
    assert str(err.value).startswith("--eps-clip-high 0.2 with --eps-clip 0.3: the upper clip bound is tighter")
    assert str(err.value).endswith(
        "Fix: use --eps-clip 0.2 --eps-clip-high 0.3, or drop --eps-clip-high for a symmetric clip."
    )
    cfg = _cfg("--eps-clip", "0.2", "--eps-clip-high", "0.28", "--eps-clip-c", "3")
    assert (cfg.eps_clip, cfg.eps_clip_high, cfg.eps_clip_c) == (0.2, 0.28, 3.0)
