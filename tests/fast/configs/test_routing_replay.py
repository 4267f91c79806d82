"""The routing-replay flags (``rl_plugin.configs.routing_replay``): the one mode the run trains
with, and each rule's refusal naming the flags, the rule and the fix."""

from __future__ import annotations

import json

import pytest

from rl_plugin.arguments import parse_args
from rl_plugin.configs.run import RunConfig
from rl_plugin.routing.engines import refusal
from tests.support.flag_rules import assert_refused


@pytest.fixture
def moe(tmp_path):
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps({"num_experts": 4, "num_experts_per_tok": 2}))
    return str(tmp_path / "moe")


@pytest.fixture
def dense(tmp_path):
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    return str(tmp_path / "dense")


@pytest.mark.parametrize(
    "flags, mode",
    [
        ("", None),
        ("--use-routing-replay", "old"),
        ("--use-rollout-routing-replay", "rollout"),
        ("--use-rollout-routing-replay --use-routing-replay", "rollout"),  # slime: both mean R3
    ],
)
def test_the_one_mode(flags, mode, moe):
    args = parse_args(f"--hf-checkpoint {moe} {flags}".split())
    assert RunConfig.from_args(args, load_user_code=False).train.routing_replay == mode


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_r3_refused_with_an_engine_that_records_no_experts(engine, moe):
    assert_refused(
        f"--hf-checkpoint {moe} --use-rollout-routing-replay --rollout-engine {engine}",
        [refusal(engine).split(". Fix:")[0], "--rollout-engine hf"],
    )


@pytest.mark.parametrize("hook", ["--custom-generate-function-path", "--rollout-function-path"])
def test_r3_refused_with_a_generation_hook(hook, moe):
    assert_refused(
        f"--hf-checkpoint {moe} --use-rollout-routing-replay {hook} m:f",
        [
            f"--use-rollout-routing-replay with {hook}",
            f"use --use-routing-replay (R2: the trainer's own old-pass routing) with {hook}",
        ],
    )


@pytest.mark.parametrize("flag", ["--use-rollout-routing-replay", "--use-routing-replay"])
def test_refused_on_the_embedded_dense_model(flag):
    assert_refused(flag, [f"{flag}: routing replay needs a mixture-of-experts model", "pass an MoE --hf-checkpoint"])


@pytest.mark.parametrize("flag", ["--use-rollout-routing-replay", "--use-routing-replay"])
def test_refused_on_a_dense_checkpoint(flag, dense):
    assert_refused(
        f"{flag} --hf-checkpoint {dense}",
        [f"{flag} with --hf-checkpoint {dense}: it is a dense model", "pass a mixture-of-experts --hf-checkpoint"],
    )


def test_r2_refused_with_rollout_logprobs(moe):
    assert_refused(
        f"--hf-checkpoint {moe} --use-routing-replay --use-rollout-logprobs",
        ["--use-routing-replay with --use-rollout-logprobs", "use --use-rollout-routing-replay (R3"],
    )


@pytest.mark.parametrize("flags", ["--use-routing-replay", "--use-rollout-routing-replay --use-rollout-logprobs"])
def test_valid_combinations_pass(flags, moe):
    parse_args(f"--hf-checkpoint {moe} {flags}".split())
