"""Validation rules of the rollout / cluster / logging flags: each rule, its message."""

import importlib.util

import pytest

from rl_plugin.arguments import RLArgumentError, parse_args

CUSTOM = ["--prompt-data", "p.jsonl", "--rollout-batch-size", "4", "--rollout-max-response-len", "8", "--num-rollout", "2", "--rm-type", "math_exact"]


def _err(argv):
    with pytest.raises(RLArgumentError) as info:
        parse_args(argv)
    return str(info.value)


@pytest.mark.parametrize("flag", ["--rollout-batch-size", "--rollout-max-response-len", "--num-rollout", "--eval-interval",
                                  "--n-samples-per-eval", "--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus", "--ray-num-cpus"])
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


def test_max_rollout_retries_not_negative():
    msg = _err(["--max-rollout-retries", "-1"])
    assert msg.startswith("--max-rollout-retries: must be >= 0 (got -1)") and "Fix:" in msg
    assert parse_args(["--max-rollout-retries", "0"]).max_rollout_retries == 0
    assert parse_args([]).max_rollout_retries == 3
