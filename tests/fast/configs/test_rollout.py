"""The rollout flags' own rules (``rl_plugin.configs.rollout``): counts, a ``--prompt-data`` run's
sizes and reward (SFT and agent runs exempt from what they do not use), the chat template's inputs
and the debug log-prob shift. (Rules across the rollout, cluster and engine flags as the command
line sees them: ``tests/fast/arguments/test_rollout.py``.)"""

from __future__ import annotations

import pytest

from rl_plugin.arguments import parse_args
from tests.support.flag_rules import assert_refused

DATA = "--prompt-data p.jsonl"
SIZES = "--rollout-batch-size 4 --rollout-max-response-len 8 --num-rollout 2"

RULES = [
    ("--rollout-batch-size 0", ["--rollout-batch-size: must be >= 1 (got 0)", "--rollout-batch-size 8"]),
    ("--num-rollout -1", ["--num-rollout: must be >= 1 (got -1)"]),
    ("--n-samples-per-eval 0", ["--n-samples-per-eval: must be >= 1 (got 0)"]),
    (
        f"{DATA} --rm-type math_exact",
        [
            "--prompt-data without --rollout-batch-size, --rollout-max-response-len, --num-rollout",
            "pass --rollout-batch-size N --rollout-max-response-len N --num-rollout N",
        ],
    ),
    (
        f"{DATA} --rm-type math_exact --rollout-batch-size 4 --num-rollout 2",
        ["--prompt-data without --rollout-max-response-len:"],
    ),
    (f"{DATA} {SIZES}", ["--prompt-data without --rm-type or --custom-rm-path", "--rm-type math_exact"]),
    (
        "--system-prompt hi",
        ["--system-prompt without --apply-chat-template", "silently ignored", "add --apply-chat-template"],
    ),
    (
        "--apply-chat-template-kwargs {}",
        ["--apply-chat-template-kwargs without --apply-chat-template"],
    ),
    (
        f"{DATA} {SIZES} --rm-type math_exact --eval-interval 2",
        ["--eval-interval without --eval-prompt-data", "pass --eval-prompt-data FILE.jsonl"],
    ),
    ("--debug-rollout-logprob-shift inf", ["--debug-rollout-logprob-shift: must be a finite number (got inf)"]),
    (
        "--debug-rollout-logprob-shift 0.5 --use-rollout-logprobs",
        ["--debug-rollout-logprob-shift with --use-rollout-logprobs", "drop --use-rollout-logprobs"],
    ),
]


@pytest.mark.parametrize("flags, fragments", RULES, ids=[r[0] for r in RULES])
def test_rule_refused_with_its_message(flags, fragments):
    assert_refused(flags, fragments)


@pytest.mark.parametrize(
    "flags",
    [
        f"{DATA} {SIZES} --rm-type math_exact --eval-interval 2 --eval-prompt-data e.jsonl",
        # SFT samples nothing: no response length, no reward
        f"{DATA} --loss-type sft_loss --rollout-batch-size 4 --num-rollout 2",
        # an agent's reward may be its own number
        f"{DATA} {SIZES} --custom-agent-function-path tests.support.agent_programs:two_turns",
        "--apply-chat-template --system-prompt hi",
        "--debug-rollout-logprob-shift 0.5",
        "--eval-interval 2",  # the embedded task brings its evaluation prompts
    ],
)
def test_valid_combinations_pass(flags):
    parse_args(flags.split())
