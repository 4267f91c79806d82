"""The dynamic-sampling (DAPO) flags' rules (``rl_plugin.configs.dynamic_sampling``)."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.registries import BUILTIN_FILTER, DYNAMIC_SAMPLING_MAX_ROUNDS
from tests.support.flag_rules import assert_refused

FILTER = f"--dynamic-sampling-filter-path {BUILTIN_FILTER}"

RULES = [
    (
        "--over-sampling-batch-size 8",
        ["--over-sampling-batch-size without --dynamic-sampling-filter-path", f"add {FILTER}"],
    ),
    (
        "--dynamic-sampling-max-rounds 3",
        ["--dynamic-sampling-max-rounds without --dynamic-sampling-filter-path", "silently ignored"],
    ),
    (
        f"{FILTER} --dynamic-sampling-max-rounds 0",
        ["--dynamic-sampling-max-rounds: must be >= 1 (got 0)", f"(default {DYNAMIC_SAMPLING_MAX_ROUNDS})"],
    ),
    (f"{FILTER} --over-sampling-batch-size 0", ["--over-sampling-batch-size: must be >= 1 (got 0)"]),
    (
        f"{FILTER} --over-sampling-batch-size 4 --rollout-batch-size 8",
        ["--over-sampling-batch-size 4 with --rollout-batch-size 8", "use --over-sampling-batch-size >= 8", "e.g. 16"],
    ),
    ("--dynamic-sampling-filter-path no_such_module_xyz:f", ["--dynamic-sampling-filter-path", "no_such_module_xyz"]),
    (
        "--overlong-penalty-factor 1.0",
        ["--overlong-penalty-factor without --overlong-buffer-len", "add --overlong-buffer-len N"],
    ),
    (
        "--overlong-buffer-len 4 --overlong-penalty-factor -1",
        ["--overlong-penalty-factor: must be a finite number >= 0 (got -1.0)"],
    ),
    ("--overlong-buffer-len 4 --overlong-penalty-factor nan", ["--overlong-penalty-factor", "(got nan)"]),
    ("--overlong-buffer-len 0", ["--overlong-buffer-len: must be >= 1 (got 0)"]),
    (
        "--overlong-buffer-len 8 --rollout-max-response-len 8",
        ["--overlong-buffer-len 8 with --rollout-max-response-len 8", "use --overlong-buffer-len < 8"],
    ),
]


@pytest.mark.parametrize("flags, fragments", RULES, ids=[r[0] for r in RULES])
def test_rule_refused_with_its_message(flags, fragments):
    assert_refused(flags, fragments)


@pytest.mark.parametrize(
    "flags",
    [
        f"{FILTER} --over-sampling-batch-size 16 --rollout-batch-size 8 --dynamic-sampling-max-rounds 3",
        "--overlong-buffer-len 4 --overlong-penalty-factor 0 --rollout-max-response-len 16",
    ],
)
def test_valid_combinations_pass(flags):
    parse_args(flags.split())
