"""--rollout-enforce-eager (issue 37 item 8): a tri-state (default: by the engine's device), vLLM only."""

import pytest

from rl_plugin.arguments import RLArgumentError, parse_args


def test_enforce_eager_tri_state():
    assert parse_args(["--rollout-engine", "vllm"]).rollout_enforce_eager is None
    assert parse_args(["--rollout-engine", "vllm", "--rollout-enforce-eager"]).rollout_enforce_eager is True
    assert parse_args(["--rollout-engine", "vllm", "--no-rollout-enforce-eager"]).rollout_enforce_eager is False


@pytest.mark.parametrize("engine", ["hf", "sglang"])
def test_enforce_eager_is_vllm_only(engine):
    with pytest.raises(RLArgumentError) as info:
        parse_args(["--rollout-engine", engine, "--no-rollout-enforce-eager"])
    msg = str(info.value)
    assert (
        msg.startswith(f"--no-rollout-enforce-eager with --rollout-engine {engine}") and "--rollout-engine vllm" in msg
    )
