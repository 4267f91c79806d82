"""The rules of --max-weight-staleness (rl_plugin/configs/async_training.py): refused values name
the flag, the rule and the fix; an uncorrected stale run is allowed with a warning that names the
two corrections. (The loop itself is tested end to end in e2e/test_loop.py.)"""

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.configs.async_training import staleness_warning
from tests.support.flag_rules import assert_refused

RULES = [
    ("--max-weight-staleness -1", ["--max-weight-staleness: must be >= 0 (got -1)", "use 0 (synchronous) or 1"]),
    (
        "--max-weight-staleness 2",
        ["--max-weight-staleness 2: only a lag of at most 1 rollout is implemented", "use --max-weight-staleness 1"],
    ),
    (
        "--max-weight-staleness 1 --colocate",
        ["--max-weight-staleness 1 with --colocate", "cannot overlap training", "drop --colocate"],
    ),
]


@pytest.mark.parametrize("flags,fragments", RULES, ids=[r[0] for r in RULES])
def test_rule_fails_loud_with_flags_rule_and_fix(flags, fragments):
    assert_refused(flags, fragments)


def test_default_is_the_synchronous_loop_without_warning():
    args = parse_args([])
    assert args.max_weight_staleness == 0 and staleness_warning(args) is None
    assert staleness_warning(parse_args(["--colocate"])) is None


@pytest.mark.parametrize("extra", [["--use-tis"], ["--use-rollout-logprobs"]])
def test_corrected_stale_run_has_no_warning(extra):
    assert staleness_warning(parse_args(["--max-weight-staleness", "1", *extra])) is None


def test_uncorrected_stale_run_is_warned_naming_both_corrections():
    line = staleness_warning(parse_args(["--max-weight-staleness", "1"]))
    assert line.startswith("warning: --max-weight-staleness 1 without --use-tis")
    assert "mismatch/*" in line and "add --use-tis" in line and "--use-rollout-logprobs" in line
