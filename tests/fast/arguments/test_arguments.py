"""Every fail-loud rule of the flags (message names the flags, the rule and the fix), the
reconciliation of --calculate-per-token-loss, the CLI checker and Megatron-LM compatibility."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from rl_plugin.arguments import (
    RLArgumentError,
    add_rl_arguments,
    build_parser,
    parse_args,
    validate_rl_args,
    validate_world,
)
from rl_plugin.arguments.docs import DOC_PATH, render
from rl_plugin.loss import LossConfig
from tests.support.flag_rules import assert_refused

RULES = [
    # (flags, fragments the message must contain)
    ("--loss-aggregation constant", ["--loss-aggregation constant", "--loss-aggregation-divisor L", "Fix:"]),
    ("--loss-aggregation constant --loss-aggregation-divisor 0", ["finite number > 0 (got 0.0)"]),
    ("--loss-aggregation constant --loss-aggregation-divisor inf", ["finite number > 0 (got inf)"]),
    ("--loss-aggregation constant --loss-aggregation-divisor nan", ["finite number > 0 (got nan)"]),
    (
        "--loss-aggregation-divisor 4096",
        [
            "--loss-aggregation-divisor with --loss-aggregation sample_mean",
            "silently ignored",
            "add --loss-aggregation constant",
        ],
    ),
    (
        "--loss-aggregation token_mean --loss-aggregation-divisor 4096",
        ["--loss-aggregation-divisor with --loss-aggregation token_mean"],
    ),
    (
        "--loss-aggregation constant --loss-aggregation-divisor 8 --calculate-per-token-loss",
        ["--loss-aggregation constant with --calculate-per-token-loss", "drop --calculate-per-token-loss"],
    ),
    (
        "--loss-aggregation prompt_mean --calculate-per-token-loss",
        ["--loss-aggregation prompt_mean with --calculate-per-token-loss"],
    ),
    (
        "--loss-aggregation sample_mean --calculate-per-token-loss",
        ["--calculate-per-token-loss with --loss-aggregation sample_mean", "legacy spelling of token_mean"],
    ),
    (
        "--custom-pg-loss-reducer-function-path a.b.c --loss-aggregation token_mean",
        ["--custom-pg-loss-reducer-function-path with --loss-aggregation token_mean", "replaces the aggregation mode"],
    ),
    (
        "--custom-pg-loss-reducer-function-path a.b.c --loss-aggregation prompt_mean --global-batch-size 16",
        ["--custom-pg-loss-reducer-function-path with --loss-aggregation prompt_mean"],
    ),
    (
        "--loss-aggregation prompt_mean --global-batch-size 10 --n-samples-per-prompt 4",
        [
            "--global-batch-size 10 and --n-samples-per-prompt 4",
            "never split a prompt group",
            "--global-batch-size 8 or 12",
        ],
    ),
    (
        "--loss-aggregation prompt_mean --docs-per-step 16",
        ["--loss-aggregation prompt_mean with --docs-per-step", "split a prompt group"],
    ),
    ("--eps-clip 0", ["--eps-clip: the clip range must be > 0 (got 0.0)"]),
    ("--eps-clip -0.1", ["--eps-clip: the clip range must be > 0"]),
    ("--eps-clip-high 0", ["--eps-clip-high: the clip range must be > 0"]),
    ("--eps-clip-c 1", ["--eps-clip-c: the dual-clip constant must be > 1 (got 1.0)"]),
    ("--eps-clip-c 0.5", ["--eps-clip-c"]),
    (
        "--context-parallel-size 2 --qkv-format bshd",
        ["--context-parallel-size 2 with --qkv-format bshd", "--seq-length"],
    ),
    ("--docs-per-step 32 --global-batch-size 64", ["--docs-per-step with --global-batch-size", "one or the other"]),
    ("--docs-per-step 0", ["--docs-per-step: must be >= 1"]),
    ("--kl-loss-coef 0.01", ["--kl-loss-coef without --use-kl-loss", "add --use-kl-loss"]),
    ("--advantage-estimator rloo --n-samples-per-prompt 1", ["--advantage-estimator rloo", ">= 2 samples per prompt"]),
    # issue 16: one sample per prompt makes every group-relative advantage 0
    (
        "--n-samples-per-prompt 1",
        [
            "--n-samples-per-prompt 1 with --advantage-estimator grpo",
            "every optimizer step is a no-op",
            "--n-samples-per-prompt >= 2",
        ],
    ),
    ("--advantage-estimator dr_grpo --n-samples-per-prompt 1", ["with --advantage-estimator dr_grpo", "group mean"]),
    (
        "--advantage-estimator reinforce_plus_plus_baseline --n-samples-per-prompt 1",
        ["with --advantage-estimator reinforce_plus_plus_baseline"],
    ),
    # issue 16: ranges of the Megatron-LM flags, checked at parse time
    ("--lr -1", ["--lr: must be >= 0.0 (got -1.0)", "--lr 1e-6"]),
    ("--lr nan", ["--lr: must be >= 0.0 (got nan)"]),
    ("--min-lr 1e-3 --lr 1e-4", ["--min-lr 0.001 with --lr 0.0001", "must not exceed the peak --lr"]),
    ("--adam-beta1 2", ["--adam-beta1: must be in [0.0, 1.0) (got 2.0)"]),
    ("--adam-beta2 1", ["--adam-beta2: must be in [0.0, 1.0) (got 1.0)"]),
    ("--adam-eps 0", ["--adam-eps: must be > 0.0 (got 0.0)"]),
    ("--weight-decay -0.1", ["--weight-decay: must be >= 0.0"]),
    ("--clip-grad -1", ["--clip-grad: must be >= 0.0 (got -1.0)", "0 disables clipping"]),
    ("--save-interval -3 --save d", ["--save-interval: must be >= 1 (got -3)"]),
    ("--save-interval 5", ["--save-interval without --save", "silently ignored"]),
    ("--log-interval 0", ["--log-interval: must be >= 1 (got 0)"]),
    ("--eps-clip-high 0.1", ["--eps-clip-high 0.1 with --eps-clip 0.2", "use --eps-clip 0.1 --eps-clip-high 0.2"]),
    ("--global-batch-size 24 --rollout-batch-size 16", ["--global-batch-size 24", "16 x 8 = 128 samples", "e.g. 16"]),
    ("--overwrite-save", ["--overwrite-save without --save", "add --save DIR"]),
    ("--overwrite-save --save d --load d", ["--overwrite-save with --load and --save the same directory"]),
    ("--n-samples-per-prompt 0", ["--n-samples-per-prompt: must be >= 1"]),
    ("--rollout-temperature 0", ["--rollout-temperature: must be a finite number > 0"]),
    ("--use-dynamic-batch-size", ["--use-dynamic-batch-size", "--max-tokens-per-gpu"]),
    ("--log-probs-chunk-size 0", ["--log-probs-chunk-size"]),
    (
        "--train-backend fsdp --context-parallel-size 2",
        ["--train-backend fsdp with --context-parallel-size 2", "use --train-backend megatron"],
    ),
    (
        "--train-backend fsdp --tensor-model-parallel-size 2",
        ["--train-backend fsdp with --tensor-model-parallel-size 2"],
    ),
    ("--lr-decay-style cosine", ["--lr-decay-style cosine", "needs its length", "pass --lr-decay-iters N"]),
    ("--train-backend fsdp --lr-decay-style linear", ["--lr-decay-style linear", "needs its length"]),
    ("--fp16", ["--train-backend megatron with --fp16", "use --bf16"]),
]


@pytest.mark.parametrize("flags,fragments", RULES, ids=[r[0] for r in RULES])
def test_rule_fails_loud_with_flags_rule_and_fix(flags, fragments):
    assert_refused(flags, fragments)


@pytest.mark.parametrize(
    "flags",
    [
        "",
        "--loss-aggregation constant --loss-aggregation-divisor 4096",
        "--loss-aggregation prompt_mean --global-batch-size 64 --n-samples-per-prompt 8",
        "--advantage-estimator gspo --eps-clip 3e-4 --eps-clip-high 4e-4 --loss-aggregation token_mean",
        "--context-parallel-size 2 --qkv-format bshd --seq-length 4096 --actor-num-gpus-per-node 2",
        "--docs-per-step 64 --use-dynamic-batch-size --max-tokens-per-gpu 8192",
        "--custom-pg-loss-reducer-function-path a.b.c --calculate-per-token-loss",
        "--use-kl-loss --kl-loss-coef 0.01 --kl-loss-type k3",
    ],
)
def test_valid_combinations_pass(flags):
    parse_args(flags.split())


def test_calculate_per_token_loss_reconciles_with_token_mean():
    assert parse_args(["--calculate-per-token-loss"]).loss_aggregation == "token_mean"
    args = parse_args(["--loss-aggregation", "token_mean"])
    assert args.calculate_per_token_loss is True
    assert parse_args([]).loss_aggregation == "sample_mean"
    assert parse_args([]).calculate_per_token_loss is False


def test_world_rule_needs_whole_micro_batches_per_rank():
    args = parse_args("--global-batch-size 12 --micro-batch-size 2 --n-samples-per-prompt 4".split())
    validate_world(args, dp_size=3)
    with pytest.raises(RLArgumentError, match="multiple of micro-batch-size x DP = 8"):
        validate_world(args, dp_size=4)


def test_works_as_megatron_extra_args_provider():
    """Megatron-LM's parser already defines its flags, --calculate-per-token-loss included: the
    provider must add only the RL flags and read Megatron's."""
    parser = argparse.ArgumentParser()
    for flag, kw in {
        "--calculate-per-token-loss": dict(action="store_true"),
        "--global-batch-size": dict(type=int),
        "--micro-batch-size": dict(type=int),
        "--context-parallel-size": dict(type=int, default=1),
        "--tensor-model-parallel-size": dict(type=int, default=1),
        "--seq-length": dict(type=int),
        "--pipeline-model-parallel-size": dict(type=int, default=1),
    }.items():
        parser.add_argument(flag, **kw)
    add_rl_arguments(parser)
    args = validate_rl_args(parser.parse_args(["--calculate-per-token-loss", "--eps-clip-high", "0.28"]))
    assert args.loss_aggregation == "token_mean" and args.eps_clip_high == 0.28
    counts = [a for a in parser._actions if "--calculate-per-token-loss" in a.option_strings]
    assert len(counts) == 1


def test_loss_config_from_args():
    cfg = LossConfig.from_args(
        parse_args(
            "--advantage-estimator gspo --loss-aggregation constant --loss-aggregation-divisor 64 --qkv-format bshd --seq-length 128".split()
        )
    )
    assert cfg.policy_loss == "gspo" and cfg.loss_aggregation == "constant" and cfg.loss_aggregation_divisor == 64.0
    assert cfg.max_seq_len == 128
    with pytest.raises(ValueError, match="cannot import"):
        LossConfig.from_args(parse_args(["--custom-pg-loss-reducer-function-path", "no_such_pkg.mod.fn"]))
    cfg = LossConfig.from_args(
        parse_args(["--custom-pg-loss-reducer-function-path", "tests.fast.parity.test_loss_layouts.custom_sample_mean"])
    )
    assert callable(cfg.custom_pg_reducer)


def _cli(*flags):
    return subprocess.run(
        [sys.executable, "-m", "rl_plugin.arguments", *flags], capture_output=True, text=True, timeout=120
    )


def test_cli_prints_resolved_json_and_exits_0():
    proc = _cli("--calculate-per-token-loss", "--n-samples-per-prompt", "4")
    assert proc.returncode == 0, proc.stderr
    settings = json.loads(proc.stdout)
    assert settings["loss_aggregation"] == "token_mean" and settings["n_samples_per_prompt"] == 4


def test_cli_invalid_combination_exits_2_with_message_on_stderr():
    proc = _cli("--loss-aggregation", "constant")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "--loss-aggregation constant" in proc.stderr and "Fix:" in proc.stderr


def test_arguments_md_documents_every_flag_and_is_current():
    parser = build_parser()
    text = DOC_PATH.read_text()
    missing = [
        s
        for a in parser._actions
        for s in a.option_strings
        if s.startswith("--") and s != "--help" and f"`{s}`" not in text
    ]
    assert not missing, f"flags missing from arguments.md: {missing}"
    assert text == render(parser), "arguments.md is stale: run python -m rl_plugin.arguments.docs"
