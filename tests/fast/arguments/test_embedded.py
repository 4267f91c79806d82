"""The embedded default's command line (``rl_plugin.arguments.embedded``): its defaults applied
only to the embedded task, explicit flags winning, LoRA's learning-rate factor, a user reward
replacing the built-in one, and a model without data / data without a model refused."""

from __future__ import annotations

import argparse

import pytest

from rl_plugin.arguments import RLArgumentError
from rl_plugin.arguments.embedded import (
    CHAR_TOKENIZER_FILE,
    EMBEDDED_DEFAULTS,
    LORA_LR_FACTOR,
    PPO_EMBEDDED_DEFAULTS,
    check_model_and_data,
    is_embedded,
    is_embedded_family,
    parse_train_flags,
)


@pytest.fixture
def family(tmp_path):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / CHAR_TOKENIZER_FILE).write_text("{}")
    return str(tmp_path / "tiny")


def _ns(prompt_data=None, hf_checkpoint=None):
    return argparse.Namespace(prompt_data=prompt_data, hf_checkpoint=hf_checkpoint)


def test_embedded_family_is_a_checkpoint_with_the_char_tokenizer(family, tmp_path):
    assert is_embedded_family(family)
    assert not is_embedded_family(str(tmp_path)) and not is_embedded_family(None)


def test_is_embedded(family, tmp_path):
    assert is_embedded(_ns()) and is_embedded(_ns(hf_checkpoint=family))
    assert not is_embedded(_ns(prompt_data="p.jsonl"))
    assert not is_embedded(_ns(hf_checkpoint=str(tmp_path)))


def test_the_embedded_run_takes_its_defaults():
    args = parse_train_flags([])
    for dest, value in EMBEDDED_DEFAULTS.items():
        assert getattr(args, dest) == value, dest


def test_explicit_flags_win_over_the_embedded_defaults():
    args = parse_train_flags(["--num-rollout", "5", "--lr", "1e-3"])
    assert (args.num_rollout, args.lr) == (5, 1e-3)
    assert args.rollout_batch_size == EMBEDDED_DEFAULTS["rollout_batch_size"]


def test_lora_scales_the_embedded_learning_rate():
    args = parse_train_flags(["--train-backend", "fsdp", "--lora-rank", "8"])
    assert args.lr == pytest.approx(LORA_LR_FACTOR * EMBEDDED_DEFAULTS["lr"]) == pytest.approx(5e-3)
    assert parse_train_flags(["--train-backend", "fsdp", "--lora-rank", "8", "--lr", "1e-3"]).lr == 1e-3


def test_ppo_takes_its_own_embedded_settings():
    args = parse_train_flags(["--advantage-estimator", "ppo"])
    assert (args.normalize_advantages, args.num_critic_only_steps) == (True, 3) == tuple(PPO_EMBEDDED_DEFAULTS.values())
    assert args.lr == EMBEDDED_DEFAULTS["lr"] and args.critic_lr is None  # the critic's lr: the actor's
    assert (
        parse_train_flags(["--advantage-estimator", "ppo", "--num-critic-only-steps", "0"]).num_critic_only_steps == 0
    )
    grpo = parse_train_flags([])  # the group estimators keep the embedded defaults as they were
    assert (grpo.normalize_advantages, grpo.num_critic_only_steps) == (False, 0)
    custom = (
        "--prompt-data p.jsonl --rollout-batch-size 4 --rollout-max-response-len 8 --num-rollout 2 --rm-type math_exact"
    )
    assert not parse_train_flags([*custom.split(), "--advantage-estimator", "ppo"]).normalize_advantages


def test_a_user_reward_replaces_the_built_in_one():
    args = parse_train_flags(["--custom-rm-path", "m:f"])
    assert args.rm_type is None and args.custom_rm_path == "m:f"


def test_a_custom_data_run_takes_no_embedded_default():
    argv = (
        "--prompt-data p.jsonl --rollout-batch-size 4 --rollout-max-response-len 8 --num-rollout 2 --rm-type math_exact"
    )
    args = parse_train_flags(argv.split())
    assert (args.micro_batch_size, args.eval_interval, args.log_interval) == (1, None, 1)


def test_a_users_model_without_data_is_refused(tmp_path):
    with pytest.raises(RLArgumentError) as err:
        parse_train_flags(["--hf-checkpoint", str(tmp_path)])
    message = str(err.value)
    assert message.startswith(f"--hf-checkpoint {tmp_path} without --prompt-data: ")
    assert "--rm-type digit_match, --lr 0.003, --num-rollout 300, --micro-batch-size 128" in message
    assert "Fix: pass --prompt-data FILE" in message


def test_data_without_a_model_is_refused(family):
    with pytest.raises(RLArgumentError) as err:
        check_model_and_data(_ns(prompt_data="p.jsonl"))
    assert str(err.value).startswith("--prompt-data p.jsonl without --hf-checkpoint: the loop needs a model")
    check_model_and_data(_ns(prompt_data="p.jsonl", hf_checkpoint=family))
    check_model_and_data(_ns())
