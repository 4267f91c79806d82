"""The rules of --max-weight-staleness (rl_plugin/configs/async_training.py): refused values name
the flag, the rule and the fix; an uncorrected stale run is allowed with a warning that names the
two corrections. (The loop itself is tested end to end in e2e/test_loop.py.)"""

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.configs.async_training import stale_drop_warning
from rl_plugin.configs.async_training import staleness_warning as _warning
from rl_plugin.configs.run import RunConfig
from tests.support.flag_rules import assert_refused


def _run(flags):
    return RunConfig.from_args(parse_args(flags), load_user_code=False)


RULES = [
    ("--max-weight-staleness -1", ["--max-weight-staleness: must be >= 0 (got -1)", "use 0 (synchronous) or 1"]),
    (
        "--max-weight-staleness 2",
        ["--max-weight-staleness 2: without --fully-async only a lag of at most 1", "add --fully-async"],
    ),
    (
        "--update-weights-interval 2",
        ["--update-weights-interval 2: applies to --fully-async only", "add --fully-async"],
    ),
    ("--fully-async", ["--fully-async: needs --max-weight-staleness K >= 1", "add --max-weight-staleness 1"]),
    (
        "--fully-async --max-weight-staleness 2 --pause-generation-mode abort",
        ["--pause-generation-mode abort with --fully-async", "miles refuses it", "use --pause-generation-mode retract"],
    ),
    (
        "--fully-async --max-weight-staleness 1 --async-max-concurrent-samples 0",
        ["--async-max-concurrent-samples: must be >= 1 (got 0)"],
    ),
    (
        "--fully-async --max-weight-staleness 1 --async-data-buffer-capacity-factor 0",
        ["--async-data-buffer-capacity-factor: must be > 0 (got 0.0)"],
    ),
    (
        "--fully-async --max-weight-staleness 1 --update-weights-interval 0",
        ["--update-weights-interval: must be >= 1 (got 0)"],
    ),
    (
        "--fully-async --max-weight-staleness 1 --update-weights-interval 2",
        ["--update-weights-interval 2 with --max-weight-staleness 1", "every group would be dropped"],
    ),
    (
        "--fully-async --max-weight-staleness 2 --colocate",
        ["--fully-async with --colocate", "cannot overlap training", "drop --colocate"],
    ),
    (
        "--fully-async --max-weight-staleness 1 --rollout-function-path tests.x:y",
        ["--fully-async with --rollout-function-path", "use --custom-generate-function-path"],
    ),
    (
        "--fully-async --max-weight-staleness 1 --custom-agent-function-path tests.x:y",
        ["--fully-async with --custom-agent-function-path", "the agent would never run", "drop --fully-async"],
    ),
    (
        "--fully-async --max-weight-staleness 1 --rollout-engine sglang",
        [
            "--rollout-engine sglang with --fully-async",
            "the SGLang client has no such pause",
            "use --rollout-engine vllm (or hf), or drop --fully-async",
        ],
    ),
    (
        "--max-weight-staleness 1 --colocate",
        ["--max-weight-staleness 1 with --colocate", "cannot overlap training", "drop --colocate"],
    ),
]


@pytest.mark.parametrize("flags,fragments", RULES, ids=[r[0] for r in RULES])
def test_rule_fails_loud_with_flags_rule_and_fix(flags, fragments):
    assert_refused(flags, fragments)


def staleness_warning(args):
    return _warning(RunConfig.from_args(args))


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


def test_fully_async_settings_parse_with_miles_names_and_defaults():
    args = parse_args(["--fully-async", "--max-weight-staleness", "4"])
    assert args.fully_async and args.max_weight_staleness == 4
    assert args.rollout_submission_granularity == "sample" and args.pause_generation_mode == "retract"
    assert args.async_data_buffer_capacity_factor == 2.0 and args.update_weights_interval == 1
    assert args.async_unused_samples_handler == "drop" and args.async_max_concurrent_samples is None
    line = staleness_warning(args)
    assert line.startswith("warning: --max-weight-staleness 4 without --use-tis") and "up to 4 rollouts" in line


def test_routing_replay_with_fully_async_is_refused():
    """(The embedded default is dense and refuses R3 first: the rule is checked on the config.)"""
    from rl_plugin.arguments import RLArgumentError
    from rl_plugin.configs.async_training import AsyncConfig

    args = parse_args(["--fully-async", "--max-weight-staleness", "1"])
    args.use_rollout_routing_replay = True
    run = RunConfig.from_args(args)
    assert isinstance(run.async_training, AsyncConfig) and run.train.routing_replay == "rollout"
    with pytest.raises(RLArgumentError) as err:
        run.async_training.check(run)
    msg = str(err.value)
    assert "--use-rollout-routing-replay with --fully-async" in msg and "not implemented" in msg and "Fix:" in msg


BATCH = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4"]


def test_update_interval_2_staleness_2_is_warned_that_groups_are_dropped_and_how_to_keep_them():
    """Issue 44 #24: ``--update-weights-interval 2 --max-weight-staleness 2`` dropped a whole batch
    every second rollout with no warning (so did the default K = 1: 8 groups every second
    rollout on the embedded run). The worker runs 8 buffered + 4 in flight = 12 groups ahead of a
    batch of 4: a group waits up to 3 rollouts, plus 1 between two publishes; K = 4 (I = 2) and
    K = 3 (I = 1) dropped none there, and are what the line asks for."""
    line = stale_drop_warning(
        _run(["--fully-async", "--max-weight-staleness", "2", "--update-weights-interval", "2", *BATCH])
    )
    assert line.startswith(
        "warning: --fully-async --max-weight-staleness 2: the worker generates up to 12 groups ahead"
    )
    assert "(8 buffered: --async-data-buffer-capacity-factor 2 x --rollout-batch-size 4; 4 in flight" in line, line
    assert "trained up to 4 rollouts behind the trainer's weights, and the groups past 2 are dropped" in line, line
    assert "async/dropped_stale" in line and "--max-weight-staleness 4, or generate less ahead" in line, line
    line = stale_drop_warning(_run(["--fully-async", "--max-weight-staleness", "1", *BATCH]))
    assert "up to 3 rollouts behind" in line and "--max-weight-staleness 3" in line, line


@pytest.mark.parametrize(
    "flags",
    [
        ["--fully-async", "--max-weight-staleness", "3"],
        ["--fully-async", "--max-weight-staleness", "4", "--update-weights-interval", "2"],
        # 1 buffered + 1 in flight (4 samples of 4) of a batch of 4: one rollout ahead at most
        [
            "--fully-async",
            "--max-weight-staleness",
            "1",
            "--async-data-buffer-capacity-factor",
            "0.25",
            "--async-max-concurrent-samples",
            "4",
        ],
        ["--max-weight-staleness", "1"],  # the overlapped loop generates one rollout ahead, no more
    ],
)
def test_no_drop_warning_when_the_bound_covers_what_is_generated_ahead(flags):
    assert stale_drop_warning(_run([*flags, *BATCH])) is None
