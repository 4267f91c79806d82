"""The generation hooks' rules (``rl_plugin.configs.custom_generation``): the combinations, the
deadlines, the agent's, and the loop's samples per step of an agent run."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.configs.custom_generation import nominal_rollout_size, steps_global_batch_size
from rl_plugin.configs.run import RunConfig
from rl_plugin.registries import BUILTIN_FILTER
from tests.support.flag_rules import assert_refused

AGENT = "--custom-agent-function-path tests.support.agent_programs:two_turns"
GEN = "--custom-generate-function-path m:f"
FN = "--rollout-function-path m:f"

RULES = [
    ("--custom-generate-timeout 5", ["--custom-generate-timeout without --custom-generate-function-path"]),
    ("--rollout-function-timeout 5", ["--rollout-function-timeout without --rollout-function-path"]),
    ("--agent-timeout 5", ["--agent-timeout without --custom-agent-function-path", "drop --agent-timeout"]),
    (
        f"{GEN} --custom-generate-timeout 0",
        ["--custom-generate-timeout: must be a positive number of seconds (got 0.0)"],
    ),
    (f"{FN} --rollout-function-timeout -1", ["--rollout-function-timeout: must be a positive number of seconds"]),
    (f"{GEN} {FN}", ["--custom-generate-function-path with --rollout-function-path", "drop one of the two"]),
    (
        f"{FN} --dynamic-sampling-filter-path {BUILTIN_FILTER}",
        ["--rollout-function-path with --dynamic-sampling-filter-path", "filter inside the rollout function"],
    ),
    (f"{AGENT} {GEN}", ["--custom-agent-function-path with --custom-generate-function-path"]),
    (f"{AGENT} {FN}", ["--custom-agent-function-path with --rollout-function-path"]),
    (
        f"{AGENT} --dynamic-sampling-filter-path {BUILTIN_FILTER}",
        ["--custom-agent-function-path with --dynamic-sampling-filter-path"],
    ),
    (
        f"{AGENT} --rollout-batch-size 2 --n-samples-per-prompt 4 --global-batch-size 4",
        ["--custom-agent-function-path with --global-batch-size 4", "use --global-batch-size 8"],
    ),
    (
        f"{AGENT} --eval-interval 2 --eval-prompt-data e.jsonl",
        ["--custom-agent-function-path with --eval-interval and no --rm-type or --custom-rm-path"],
    ),
]


@pytest.mark.parametrize("flags, fragments", RULES, ids=[r[0] for r in RULES])
def test_rule_refused_with_its_message(flags, fragments):
    assert_refused(flags, fragments)


def _run(flags: str) -> RunConfig:
    return RunConfig.from_args(parse_args(flags.split()), load_user_code=False)


def test_nominal_rollout_size_is_prompts_times_samples():
    assert nominal_rollout_size(_run("--rollout-batch-size 3 --n-samples-per-prompt 4")) == 12
    assert nominal_rollout_size(_run("")) is None


def test_agent_step_at_the_nominal_size_is_one_step_per_rollout():
    flags = "--rollout-batch-size 2 --n-samples-per-prompt 4 --global-batch-size 8"
    assert steps_global_batch_size(_run(f"{AGENT} {flags}")) is None
    assert steps_global_batch_size(_run(flags)) == 8  # no agent: the flag as given
    assert steps_global_batch_size(_run("--rollout-batch-size 2 --n-samples-per-prompt 4 --global-batch-size 4")) == 4
