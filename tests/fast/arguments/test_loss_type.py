"""Issue 35, the rules of --loss-type sft_loss (rl_plugin/loss_config/loss_type.py): the flags that
mean nothing without sampled rollouts are refused naming both, the rule and the fix; SFT takes one
sample per conversation by default and needs no reward or response length."""

import pytest

from rl_plugin.arguments import parse_args
from tests.support.flag_rules import assert_refused

SFT = "--loss-type sft_loss"
RULES = [
    (f"{SFT} --use-tis", ["--loss-type sft_loss with --use-tis", "no sampling engine", "drop --use-tis"]),
    (f"{SFT} --use-kl-loss", ["with --use-kl-loss", "no reference model"]),
    (f"{SFT} --use-rollout-logprobs", ["with --use-rollout-logprobs", "no engine log-probs"]),
    (f"{SFT} --custom-generate-function-path m:f", ["with --custom-generate-function-path", "nothing is generated"]),
    (f"{SFT} --rollout-function-path m:f", ["with --rollout-function-path"]),
    (f"{SFT} --max-weight-staleness 1", ["with --max-weight-staleness 1", "SFT generates nothing that could overlap"]),
    (f"{SFT} --n-samples-per-prompt 4", ["with --n-samples-per-prompt 4", "trained on that many times per step"]),
    (f"{SFT} --custom-rm-path m:f", ["with --custom-rm-path", "nothing is scored"]),
    (f"{SFT} --rollout-temperature 0.7", ["with --rollout-temperature 0.7", "temperature 1"]),
    (f"{SFT} --entropy-coef 0.01", ["with --entropy-coef", "drop --entropy-coef"]),
]


@pytest.mark.parametrize("flags,fragments", RULES, ids=[r[0] for r in RULES])
def test_rule_fails_loud_with_flags_rule_and_fix(flags, fragments):
    assert_refused(flags, fragments)


def test_sft_defaults_one_sample_per_conversation_and_needs_no_reward(tmp_path):
    args = parse_args(f"{SFT} --prompt-data {tmp_path}/d.jsonl --rollout-batch-size 4 --num-rollout 2".split())
    assert args.loss_type == "sft_loss" and args.n_samples_per_prompt == 1
    assert parse_args([]).loss_type == "policy_loss" and parse_args([]).n_samples_per_prompt == 8


OPD_RULES = [
    ("--opd-kl-coef 0.5", ["--opd-kl-coef without --use-opd", "silently ignored", "add --use-opd"]),
    ("--opd-teacher-load d --opd-type hf", ["--opd-type, --opd-teacher-load without --use-opd"]),
    ("--use-opd", ["--use-opd without --opd-teacher-load", "needs a teacher", "pass --opd-teacher-load DIR"]),
    (
        "--use-opd --opd-teacher-load d --opd-type sglang",
        ["--opd-type sglang", "cannot run", "use --opd-type megatron"],
    ),
    ("--use-opd --opd-teacher-load d --opd-kl-coef 0", ["--opd-kl-coef 0.0", "must be > 0"]),
    ("--use-opd --opd-teacher-load d --opd-kl-coef -1", ["--opd-kl-coef -1.0", "must be > 0"]),
    ("--use-opd --opd-teacher-load d --opd-teacher-ckpt-step 3", ["--opd-teacher-ckpt-step", "--save-hf directory"]),
    ("--opd-teacher-max-tokens 64", ["--opd-teacher-max-tokens without --use-opd", "add --use-opd"]),
    (
        "--use-opd --opd-teacher-load d --opd-type vllm --opd-teacher-max-tokens 64",
        [
            "--opd-teacher-max-tokens with --opd-type vllm",
            "only the --opd-type hf teacher reads it",
            "use --opd-type hf",
        ],
    ),
    (
        "--use-opd --opd-teacher-load d --opd-type hf --opd-teacher-gpu-memory-utilization 0.5",
        ["--opd-teacher-gpu-memory-utilization with --opd-type hf", "use --opd-type vllm, or drop"],
    ),
    (
        "--use-opd --opd-teacher-load d --opd-type hf --opd-teacher-max-tokens 0",
        ["--opd-teacher-max-tokens: must be >= 1 (got 0)"],
    ),
    (
        "--use-opd --opd-teacher-load d --opd-type vllm --opd-teacher-gpu-memory-utilization 1",
        ["--opd-teacher-gpu-memory-utilization: must be in (0, 1) (got 1.0)"],
    ),
    (f"{SFT} --use-opd --opd-teacher-load d", ["--loss-type sft_loss with --use-opd", "student's own samples"]),
]


@pytest.mark.parametrize("flags,fragments", OPD_RULES, ids=[r[0] for r in OPD_RULES])
def test_opd_rule_fails_loud_with_flags_rule_and_fix(flags, fragments):
    assert_refused(flags, fragments)


@pytest.mark.parametrize("kind", ["megatron", "hf", "vllm"])
def test_opd_types_accepted(kind):
    args = parse_args(["--use-opd", "--opd-teacher-load", "d", "--opd-type", kind])
    assert args.use_opd and args.opd_type == kind and args.opd_kl_coef == 1.0
