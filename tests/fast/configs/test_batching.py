"""The batching flags' rules (``rl_plugin.configs.batching``): each refused combination names the
flags, the rule and the fix; the token budget derived only with --use-dynamic-batch-size."""

from __future__ import annotations

import pytest

from rl_plugin.arguments import RLArgumentError, parse_args
from rl_plugin.configs.batching import BatchingConfig
from rl_plugin.configs.run import RunConfig, check_world
from tests.support.flag_rules import assert_refused

RULES = [
    (
        "--n-samples-per-prompt 1 --advantage-estimator grpo",
        ["--n-samples-per-prompt 1 with --advantage-estimator grpo", "group mean", "--n-samples-per-prompt >= 2"],
    ),
    (
        "--n-samples-per-prompt 1 --advantage-estimator rloo",
        ["--n-samples-per-prompt 1 with --advantage-estimator rloo", "leave-one-out mean"],
    ),
    ("--n-samples-per-prompt 0", ["--n-samples-per-prompt: must be >= 1 (got 0)"]),
    ("--micro-batch-size 0", ["--micro-batch-size: must be >= 1 (got 0)", "--micro-batch-size 1"]),
    ("--global-batch-size 0", ["--global-batch-size: must be >= 1 (got 0)", "use a positive sample count"]),
    (
        "--rollout-batch-size 3 --n-samples-per-prompt 4 --global-batch-size 5",
        [
            "--global-batch-size 5",
            "--rollout-batch-size x --n-samples-per-prompt = 3 x 4 = 12 samples",
            "divides 12, e.g. 4",  # the largest divisor of 12 not above 5
        ],
    ),
    (
        "--loss-aggregation prompt_mean --n-samples-per-prompt 4 --global-batch-size 6",
        [
            "--loss-aggregation prompt_mean with --global-batch-size 6 and --n-samples-per-prompt 4",
            "never split a prompt group",
            "use --global-batch-size 4 or 8",
        ],
    ),
    (
        "--context-parallel-size 2 --qkv-format bshd --actor-num-gpus-per-node 2",
        ["--context-parallel-size 2 with --qkv-format bshd", "--seq-length", "--qkv-format thd"],
    ),
    ("--use-dynamic-batch-size", ["--use-dynamic-batch-size: needs a token budget", "pass --max-tokens-per-gpu N"]),
    ("--max-tokens-per-gpu 0", ["--max-tokens-per-gpu: must be >= 1 (got 0)"]),
    ("--docs-per-step 0", ["--docs-per-step: must be >= 1 (got 0)", "use a positive document count"]),
    (
        "--docs-per-step 4 --global-batch-size 8",
        ["--docs-per-step with --global-batch-size", "drop one of the two flags"],
    ),
    (
        "--docs-per-step 4 --loss-aggregation prompt_mean --n-samples-per-prompt 4",
        ["--loss-aggregation prompt_mean with --docs-per-step", "a multiple of --n-samples-per-prompt (4)"],
    ),
]


@pytest.mark.parametrize("flags, fragments", RULES, ids=[r[0] for r in RULES])
def test_rule_refused_with_its_message(flags, fragments):
    assert_refused(flags, fragments)


@pytest.mark.parametrize(
    "flags",
    [
        "--n-samples-per-prompt 1 --loss-type sft_loss",  # SFT has no advantage: one sample is the default
        "--rollout-batch-size 3 --n-samples-per-prompt 4 --global-batch-size 6",
        "--loss-aggregation prompt_mean --n-samples-per-prompt 4 --global-batch-size 8",
        "--use-dynamic-batch-size --max-tokens-per-gpu 512 --docs-per-step 4",
        "--context-parallel-size 2 --qkv-format bshd --seq-length 64 --actor-num-gpus-per-node 2",
    ],
)
def test_valid_combinations_pass(flags):
    parse_args(flags.split())


def test_token_budget_is_derived_only_with_dynamic_batching():
    assert BatchingConfig.from_args(parse_args(["--max-tokens-per-gpu", "256"])).max_tokens_per_gpu is None
    c = BatchingConfig.from_args(parse_args("--use-dynamic-batch-size --max-tokens-per-gpu 256".split()))
    assert (c.use_dynamic_batch_size, c.token_budget, c.max_tokens_per_gpu) == (True, 256, 256)


def test_check_world_skips_dynamic_batching():
    """With a token budget the micro-batch count per rank is not the global batch over the micro-batch
    size, so the whole-micro-batches rule does not apply."""
    args = parse_args(
        "--global-batch-size 6 --micro-batch-size 4 --use-dynamic-batch-size --max-tokens-per-gpu 64".split()
    )
    check_world(RunConfig.from_args(args, load_user_code=False), dp_size=1)
    run = RunConfig.from_args(parse_args("--global-batch-size 6 --micro-batch-size 4".split()), load_user_code=False)
    with pytest.raises(RLArgumentError, match=r"make --global-batch-size a multiple of micro-batch-size x DP = 4"):
        check_world(run, dp_size=1)
