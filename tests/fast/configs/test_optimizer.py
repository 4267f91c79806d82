"""The optimizer flags' rules (``rl_plugin.configs.optimizer``)."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.configs.optimizer import OptimizerConfig
from tests.support.flag_rules import assert_refused

RULES = [
    ("--lr-decay-style cosine", ["--lr-decay-style cosine", "no --train-iters", "pass --lr-decay-iters N"]),
    ("--lr-decay-style linear", ["--lr-decay-style linear", "--lr-decay-style constant"]),
    (
        "--lr 1e-5 --min-lr 1e-4",
        ["--min-lr 0.0001 with --lr 1e-05", "must not exceed the peak --lr", "--min-lr <= 1e-05"],
    ),
]


@pytest.mark.parametrize("flags, fragments", RULES, ids=[r[0] for r in RULES])
def test_rule_refused_with_its_message(flags, fragments):
    assert_refused(flags, fragments)


@pytest.mark.parametrize(
    "flags", ["--lr-decay-style cosine --lr-decay-iters 10", "--lr 1e-5 --min-lr 1e-5", "--lr 1e-5 --min-lr 0"]
)
def test_valid_combinations_pass(flags):
    parse_args(flags.split())


def test_defaults():
    c = OptimizerConfig()
    assert (c.lr, c.min_lr, c.lr_decay_style, c.lr_warmup_iters, c.lr_decay_iters) == (1e-6, 0.0, "constant", 0, None)
