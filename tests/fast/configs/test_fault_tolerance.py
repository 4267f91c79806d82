"""The fault-tolerance flags' rules (``rl_plugin.configs.fault_tolerance``) and their defaults."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.configs.fault_tolerance import FaultToleranceConfig
from tests.support.flag_rules import assert_refused

RULES = [
    ("--max-rollout-retries -1", ["--max-rollout-retries: must be >= 0 (got -1)", "use 0 to stop at the first"]),
    ("--exit-signal-grace-s 0", ["--exit-signal-grace-s: must be a positive number of seconds (got 0.0)"]),
    ("--exit-signal-grace-s -3", ["--exit-signal-grace-s: must be a positive number of seconds (got -3.0)"]),
    ("--exit-signal-grace-s inf", ["--exit-signal-grace-s: must be a positive number of seconds (got inf)"]),
    ("--exit-signal-grace-s nan", ["--exit-signal-grace-s: must be a positive number of seconds (got nan)"]),
    ("--exit-duration-in-mins 0", ["--exit-duration-in-mins: must be a positive number of minutes (got 0.0)"]),
    ("--exit-duration-in-mins inf", ["--exit-duration-in-mins", "--exit-duration-in-mins 230"]),
]


@pytest.mark.parametrize("flags, fragments", RULES, ids=[r[0] for r in RULES])
def test_rule_refused_with_its_message(flags, fragments):
    assert_refused(flags, fragments)


def test_defaults_and_valid_values():
    assert FaultToleranceConfig() == FaultToleranceConfig(3, True, 20.0, None)
    args = parse_args(
        "--max-rollout-retries 0 --no-exit-signal-handler --exit-signal-grace-s 0.5 --exit-duration-in-mins 1.5".split()
    )
    c = FaultToleranceConfig.from_args(args)
    assert (c.max_rollout_retries, c.exit_signal_handler, c.exit_signal_grace_s, c.exit_duration_in_mins) == (
        0,
        False,
        0.5,
        1.5,
    )
