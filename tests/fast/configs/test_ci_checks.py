"""The --ci-test flags (``rl_plugin.configs.ci_checks``): the threshold refused without --ci-test,
negative or not finite, under SFT, with --use-rollout-logprobs and with a loop that generates
ahead; --ci-test turns on the weight-sync fingerprints and the steps' worst-token report."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.configs.ci_checks import CiChecks
from rl_plugin.configs.run import RunConfig
from tests.support.flag_rules import assert_refused

T = "--ci-train-rollout-logprob-abs-diff-threshold"


def test_threshold_without_ci_test_is_refused_naming_both_flags():
    assert_refused(f"{T} 0", [f"{T} without --ci-test", "Fix: add --ci-test"])


@pytest.mark.parametrize("value", ["-1e-6", "nan", "inf"])
def test_negative_or_non_finite_threshold_is_refused(value):
    assert_refused(f"--ci-test {T}={value}", [f"{T} {float(value)}", "finite number >= 0", f"{T} 0 (bitwise)"])


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ("--loss-type sft_loss", "SFT samples nothing"),
        ("--use-rollout-logprobs", "compare them with themselves"),
        ("--max-weight-staleness 1", "the update, not the kernels"),
    ],
)
def test_threshold_refused_where_it_cannot_measure_the_kernels(extra, fragment):
    assert_refused(f"--ci-test {T} 0 {extra}", [fragment])


def test_ci_test_turns_on_the_fingerprints_and_the_worst_token_report():
    run = RunConfig.from_args(parse_args(["--ci-test", T, "0"]), load_user_code=False)
    assert run.ci == CiChecks(ci_test=True, logprob_abs_diff_threshold=0.0)
    assert run.sync.fingerprint and run.train.loss.report_worst_token
    alone = RunConfig.from_args(parse_args(["--ci-test"]), load_user_code=False)
    assert alone.sync.fingerprint and not alone.train.loss.report_worst_token
    off = RunConfig.from_args(parse_args([]), load_user_code=False)
    assert off.ci == CiChecks() and not off.sync.fingerprint and not off.train.loss.report_worst_token


@pytest.mark.parametrize(
    "flags, tolerance",
    [
        (["--ci-test", "--use-kl-loss", "--true-on-policy-mode"], 0.0),  # the mode: bitwise
        (["--ci-test", "--use-kl-loss", T, "1e-4"], 1e-4),  # else the threshold
        (["--ci-test", "--use-kl-loss"], None),  # neither: not checked
        (["--ci-test", T, "0", "--true-on-policy-mode"], None),  # no reference model
        (["--use-kl-loss", "--true-on-policy-mode"], None),  # no --ci-test
    ],
)
def test_the_actor_ref_check_is_bitwise_under_the_mode_else_within_the_threshold(flags, tolerance):
    run = RunConfig.from_args(parse_args(flags), load_user_code=False)
    assert run.ci.actor_ref_tolerance == tolerance
    assert run.train.loss.report_actor_ref == (tolerance is not None)
