"""The loss-type part (``rl_plugin.loss_config.loss_type``): ``is_sft``, and SFT's refusal of the
flags that mean nothing without sampled rollouts, one message per flag. (The other refusals:
``tests/fast/arguments/test_loss_type.py``.)"""

from __future__ import annotations

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.configs.run import RunConfig
from rl_plugin.errors import RLArgumentError
from rl_plugin.loss_config.loss_type import LOSS_TYPES


def test_is_sft():
    assert LOSS_TYPES == ("policy_loss", "sft_loss")
    # the run config derives it once from the run's mode (rl_plugin.configs.mode)
    assert RunConfig.from_args(parse_args(["--loss-type", "sft_loss"]), load_user_code=False).train.loss.is_sft
    assert not RunConfig.from_args(parse_args([]), load_user_code=False).train.loss.is_sft


@pytest.mark.parametrize(
    "flags, named, why",
    [
        ("--dynamic-sampling-filter-path a.b:c", "--dynamic-sampling-filter-path", "SFT samples no groups to filter"),
        ("--use-opd --opd-teacher-load d", "--use-opd", "distillation needs the student's own samples"),
    ],
)
def test_sft_refuses_sampling_flags(flags, named, why):
    with pytest.raises(RLArgumentError) as err:
        parse_args(["--loss-type", "sft_loss", *flags.split()])
    assert (
        str(err.value)
        == f"--loss-type sft_loss with {named}: {why}. Fix: drop {named}, or use --loss-type policy_loss."
    )


def test_the_policy_loss_accepts_them():
    args = parse_args("--use-opd --opd-teacher-load d".split())
    assert args.loss_type == "policy_loss" and args.use_opd
