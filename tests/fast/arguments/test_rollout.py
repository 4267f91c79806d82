"""Validation rules of the rollout / cluster / logging flags: each rule, its message."""

import importlib.util

import pytest

from rl_plugin.arguments import RLArgumentError, parse_args

CUSTOM = [
    "--prompt-data",
    "p.jsonl",
    "--rollout-batch-size",
    "4",
    "--rollout-max-response-len",
    "8",
    "--num-rollout",
    "2",
    "--rm-type",
    "math_exact",
]


def _err(argv):
    with pytest.raises(RLArgumentError) as info:
        parse_args(argv)
    return str(info.value)


@pytest.mark.parametrize(
    "flag",
    [
        "--rollout-batch-size",
        "--rollout-max-response-len",
        "--num-rollout",
        "--eval-interval",
        "--n-samples-per-eval",
        "--actor-num-nodes",
        "--actor-num-gpus-per-node",
        "--rollout-num-gpus",
        "--rollout-num-gpus-per-engine",
        "--ray-num-cpus",
    ],
)
def test_counts_must_be_positive(flag):
    msg = _err([flag, "0"])
    assert msg.startswith(f"{flag}: must be >= 1 (got 0)") and "Fix:" in msg


@pytest.mark.parametrize("p", ["0", "1.5", "nan"])
def test_top_p_range(p):
    assert f"--rollout-top-p: must be in (0, 1] (got {float(p)})" in _err(["--rollout-top-p", p])


def test_custom_rm_with_rm_type():
    assert "--custom-rm-path with --rm-type" in _err(["--custom-rm-path", "m:f", "--rm-type", "math_exact"])


def test_prompt_data_needs_rollout_sizes():
    msg = _err(["--prompt-data", "p.jsonl", "--rm-type", "math_exact", "--num-rollout", "3"])
    assert "--prompt-data without --rollout-batch-size, --rollout-max-response-len" in msg
    assert "pass --rollout-batch-size N --rollout-max-response-len N" in msg


def test_prompt_data_needs_reward():
    argv = [a for a in CUSTOM if a not in ("--rm-type", "math_exact")]
    assert "--prompt-data without --rm-type or --custom-rm-path" in _err(argv)


def test_eval_interval_needs_eval_data():
    assert "--eval-interval without --eval-prompt-data" in _err(CUSTOM + ["--eval-interval", "2"])


def test_valid_custom_dataset_flags_pass():
    args = parse_args(CUSTOM + ["--eval-interval", "2", "--eval-prompt-data", "e.jsonl"])
    assert args.rollout_batch_size == 4 and args.rollout_engine == "hf"


def test_colocate_with_rollout_gpus():
    assert "--colocate with --rollout-num-gpus" in _err(["--colocate", "--rollout-num-gpus", "2"])


def test_world_multiple_of_model_parallel():
    msg = _err(["--actor-num-gpus-per-node", "3", "--tensor-model-parallel-size", "2"])
    assert "= 3 training ranks: the world must be a multiple of TP x CP x PP = 2" in msg


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_use_wandb_without_wandb():
    assert "--use-wandb: the wandb package is not installed" in _err(["--use-wandb"])


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_missing_engine_package_fails_at_start_up(engine, monkeypatch, capsys):
    """rl-plugin-train exits 2 before starting Ray, naming the flag and the install step (the
    flag checker alone accepts the flag: examples validate on machines without the package)."""
    from rl_plugin.train import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == engine else real(name, *a))
    parse_args(["--rollout-engine", engine])
    assert main(["--train-backend", "fsdp", "--rollout-engine", engine]) == 2
    msg = capsys.readouterr().err
    assert f"--rollout-engine {engine}: the Python package '{engine}' is not installed" in msg
    assert (
        "scripts/setup_env.sh" if engine == "vllm" else "pip install"
    ) in msg and "or use --rollout-engine hf" in msg


def test_rollout_gpus_split_into_whole_engines():
    msg = _err(["--rollout-engine", "vllm", "--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"])
    assert (
        "--rollout-num-gpus 3 with --rollout-num-gpus-per-engine 2: the rollout GPUs must split into whole engines"
        in msg
    )


def test_hf_engine_has_no_tensor_parallelism():
    msg = _err(["--rollout-num-gpus-per-engine", "2"])
    assert (
        msg.startswith("--rollout-engine hf with --rollout-num-gpus-per-engine 2")
        and "use --rollout-engine vllm" in msg
    )


def test_weight_buffer_must_be_positive():
    assert _err(["--update-weight-buffer-size", "0"]).startswith(
        "--update-weight-buffer-size: must be >= 1 byte (got 0)"
    )


def test_max_rollout_retries_not_negative():
    msg = _err(["--max-rollout-retries", "-1"])
    assert msg.startswith("--max-rollout-retries: must be >= 0 (got -1)") and "Fix:" in msg
    assert parse_args(["--max-rollout-retries", "0"]).max_rollout_retries == 0
    assert parse_args([]).max_rollout_retries == 3


AGENT = ["--custom-agent-function-path", "tests.support.agent_programs:two_turns"]


@pytest.mark.parametrize(
    "other, value",
    [
        ("--custom-generate-function-path", "m:f"),
        ("--rollout-function-path", "m:f"),
        ("--dynamic-sampling-filter-path", "m:f"),
    ],
)
def test_agent_replaces_the_other_generation_hooks(other, value):
    msg = _err(CUSTOM + AGENT + [other, value])
    assert f"--custom-agent-function-path with {other}" in msg and "Fix: drop one of the two" in msg


def test_agent_rollouts_are_not_cut_into_fixed_size_steps():
    msg = _err(CUSTOM + AGENT + ["--global-batch-size", "4", "--n-samples-per-prompt", "2"])
    assert "--custom-agent-function-path with --global-batch-size 4" in msg and "--docs-per-step" in msg
    assert "Fix: use --global-batch-size 8 (--rollout-batch-size x --n-samples-per-prompt" in msg


def test_agent_accepts_the_rollouts_nominal_global_batch_size():
    """Issue 44 item 15: slime's usual flags give --global-batch-size = rollout x n; it means one
    step per rollout, however many samples the episodes made (was refused)."""
    from rl_plugin.loop.config import LoopConfig

    args = parse_args(CUSTOM + AGENT + ["--global-batch-size", "8", "--n-samples-per-prompt", "2"])
    assert args.global_batch_size == 8 and LoopConfig.from_args(args).global_batch_size is None
    plain = parse_args(CUSTOM + ["--global-batch-size", "8", "--n-samples-per-prompt", "2"])
    assert LoopConfig.from_args(plain).global_batch_size == 8  # other runs: unchanged


def test_agent_needs_no_reward_flag_but_its_evaluation_does():
    """Issue 44 item 15: the agent's number is the reward (--rm-type was demanded); the
    evaluation keeps the plain rollout, which needs the run's reward."""
    no_rm = CUSTOM[:-2]
    assert parse_args(no_rm + AGENT).rm_type is None
    assert "--prompt-data without --rm-type or --custom-rm-path" in _err(no_rm)
    msg = _err(no_rm + AGENT + ["--eval-prompt-data", "e.jsonl", "--eval-interval", "1"])
    assert "--custom-agent-function-path with --eval-interval and no --rm-type or --custom-rm-path" in msg


@pytest.mark.parametrize(
    "flag, hook",
    [
        ("--agent-timeout", "--custom-agent-function-path"),
        ("--custom-generate-timeout", "--custom-generate-function-path"),
        ("--rollout-function-timeout", "--rollout-function-path"),
    ],
)
def test_a_hook_deadline_without_its_hook_is_refused(flag, hook):
    """Issue 44 item 24: as --rm-timeout without a reward that reads it (they were accepted and
    silently ignored)."""
    msg = _err(CUSTOM + [flag, "60"])
    assert (
        f"{flag} without {hook}: it bounds a call of {hook}'s function" in msg
        and f"Fix: add {hook}, or drop {flag}" in msg
    )


@pytest.mark.parametrize("value", ["0", "-1", "inf"])
def test_agent_timeout_must_be_positive(value):
    assert "--agent-timeout: must be a positive number of seconds" in _err(CUSTOM + AGENT + ["--agent-timeout", value])


def test_agent_flags_pass():
    args = parse_args(CUSTOM + AGENT + ["--agent-timeout", "60"])
    assert args.custom_agent_function_path.endswith(":two_turns") and args.agent_timeout == 60.0
