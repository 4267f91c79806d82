"""Issue 44 items 8, 9, 14, 15 and 23: the agent endpoint against agents that block their event
loop, hostile requests and concurrent floods, on the hf engine and a tiny random Llama carrying
SmolLM2's real tokenizer (``agent/test_rollout``'s setup; the agents are
``tests.support.agent_programs``)."""

from __future__ import annotations

import json
import re
import time
import traceback

import pytest

pytest.importorskip("openai")

from rl_plugin.arguments.embedded import parse_train_flags  # noqa: E402
from rl_plugin.configs import RolloutConfig  # noqa: E402
from rl_plugin.configs.run import RunConfig  # noqa: E402
from rl_plugin.loop.preflight import check_reward_and_data  # noqa: E402
from rl_plugin.ray.rollout_actor import error_line  # noqa: E402
from rl_plugin.rollout.agent.rollout import AgentError, AgentRaisedError, AgentTimeoutError  # noqa: E402
from rl_plugin.rollout.agent.server import LOOPBACK, MAX_JSON_DEPTH, MAX_REQUEST_BYTES  # noqa: E402
from rl_plugin.rollout.manager import RolloutManager  # noqa: E402
from tests.fast.rollout.agent.test_rollout import manager, setup  # noqa: E402,F401 - the module's fixture
from tests.support import agent_programs as agents  # noqa: E402


def test_an_agent_with_a_blocking_http_client_completes(setup):  # noqa: F811
    """Item 8: the synchronous openai client and urllib inside `async def run_agent`. Before, the
    endpoint was served in the agents' own event loop, which the blocking call held: the request
    waited on a server that could not run, until the client's own 15 s timeout (APITimeoutError)."""
    t0 = time.perf_counter()
    data = manager(setup, "sync_clients", "--agent-timeout", "60", batch=1, n=2).generate(0)
    took = time.perf_counter() - t0
    assert len(agents.SEEN["sync_clients"]) == 2 and data.stats["agent/calls"] == 4
    for served, status, second in agents.SEEN["sync_clients"]:
        assert served >= 1 and status == 200 and second >= 1
    assert took < 12, took


def test_an_agent_that_blocks_its_loop_ends_at_the_timeout_naming_where(setup):  # noqa: F811
    """Item 8: `time.sleep(6)` inside `async def` with --agent-timeout 0.5: a blocked loop cannot
    fire asyncio's deadline; the watcher ends the rollout LOOP_GRACE_S past it, naming the sample
    and the line that blocks (before: the error came only when the sleep returned, 6 s, and said
    nothing of the blocking)."""
    m = manager(setup, "blocks", "--agent-timeout", "0.5", batch=1, n=2)
    t0 = time.perf_counter()
    with pytest.raises(AgentTimeoutError) as err:
        m.generate(0)
    took = time.perf_counter() - t0
    msg = str(err.value)
    assert re.search(r"did not return within --agent-timeout 0.5 s on sample [01] \(group 0", msg), msg
    assert "it blocks the agents' event loop at " in msg and "agent_programs.py:" in msg, msg
    assert "`time.sleep(6)`" in msg and "asyncio.to_thread" in msg, msg
    assert took < 4.5, took


def test_hostile_requests_are_refused_for_that_request_only(setup):  # noqa: F811
    """Items 9, 14, 23: an id past the vocabulary (prompt or stop), a body nested 100k deep, one
    over the size limit and one without the run's token are each refused with a 4xx naming what
    is wrong; the same session then completes normally (before: the out-of-vocabulary id failed
    the engine call, a 500; the nested body a 500 with a traceback; no token existed; 256 MB
    were accepted)."""
    m = manager(setup, "hostile", batch=1, n=2)
    data = m.generate(0)
    out = agents.SEEN["hostile"][0]
    vocab = m.generation.vocab_size
    status, body = out["oov_prompt"]
    assert status == 400 and body["error"]["param"] == "prompt", out["oov_prompt"]
    assert f"token id 1000000 (position 2) is outside the model's vocabulary [0, {vocab})" in body["error"]["message"]
    status, body = out["oov_stop"]
    assert status == 400 and body["error"]["param"] == "stop_token_ids" and "999999" in body["error"]["message"]
    status, body = out["nested"]
    assert status == 400 and f"nests deeper than {MAX_JSON_DEPTH} levels" in body["error"]["message"]
    status, body = out["too_large"]
    assert status == 413 and str(MAX_REQUEST_BYTES) in body["error"]["message"]
    status, body = out["no_token"]
    assert status == 401 and "run token" in body["error"]["message"]
    status, body = out["ok"]
    assert status == 200 and body["usage"]["completion_tokens"] >= 1
    assert data.stats["agent/calls"] == 2 and data.rewards.tolist() == [1.0, 1.0]
    server = m.generation.agent.server
    assert server.sock.getsockname()[0] == LOOPBACK == server.host
    assert server.base_url("abc") == f"http://127.0.0.1:{server.port}/{server.token}/sessions/abc"
    assert len(server.token) == 32


def test_concurrent_requests_share_the_episode_budget(setup):  # noqa: F811
    """Item 23: 200 concurrent requests on one session with an 8-token budget. Before, each saw
    the whole budget (812 tokens trained on one run of the sweep); now it is reserved before the
    engine call."""
    data = manager(setup, "flood", batch=1, n=2, max_len=8).generate(0)
    served = agents.SEEN["flood"]
    assert len(served) == 2 and all(1 <= s <= 8 for s in served), served
    assert data.stats["agent/model_tokens"] == sum(served) <= 16, data.stats


def test_a_raising_agent_keeps_its_message_across_ray(setup):  # noqa: F811
    """Item 23: the driver shows a remote error by its last `...Error:` line; the agent's error
    classes did not end in `Error`, so the driver showed the agent's bare exception (no agent,
    no file:line, no sample)."""
    import ray

    with pytest.raises(AgentRaisedError) as err:
        manager(setup, "raises", batch=1, n=2).generate(0)
    exc = err.value
    remote = ray.exceptions.RayTaskError("generate", "".join(traceback.format_exception(exc)), exc)
    line = error_line(remote)
    assert line.startswith("rl_plugin.rollout.agent.rollout.AgentRaisedError: --custom-agent-function-path"), line
    assert "raised on sample" in line and "agent_programs.py:" in line and "no 'result'" in line, line


def _args(setup, agent: str, data=None):  # noqa: F811
    """An agent run's flags with no reward configured (the agent's number is the reward)."""
    root, model, default_data = setup
    argv = ["--hf-checkpoint", str(model), "--prompt-data", str(data or default_data), "--rollout-batch-size", "1"]
    argv += ["--n-samples-per-prompt", "2", "--rollout-max-response-len", "8", "--num-rollout", "1"]
    argv += ["--custom-agent-function-path", f"tests.support.agent_programs:{agent}", "--output-dir", str(root / "o")]
    return parse_train_flags(argv)


def _manager(setup, agent: str, data=None):  # noqa: F811
    agents.SEEN.clear()
    args = _args(setup, agent, data)
    return RolloutManager(RolloutConfig.from_args(args), args.hf_checkpoint, args.prompt_data, None, args=args)


def test_the_agents_reward_needs_no_rm_and_chat_data_no_template_flag(setup, tmp_path):  # noqa: F811
    """Item 15: no --rm-type / --custom-rm-path when the agent returns its reward, and chat-message
    data without --apply-chat-template (the endpoint renders every chat with the checkpoint's
    template; sample.prompt is that text). Before, both were refused at parse / generate."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"prompt": [{"role": "user", "content": "What is 1 + 2?"}], "label": "3"}) + "\n")
    run = RunConfig.from_args(_args(setup, "scored", chats), load_user_code=False)
    check_reward_and_data(run)  # the preflight's file checks accept them too
    data = _manager(setup, "scored", data=chats).generate(0)
    assert data.stats["agent/samples"] == 2 and data.rewards.tolist() == [0.25, 0.25]
    assert agents.SEEN["scored"] == [[{"role": "user", "content": "What is 1 + 2?"}]] * 2  # the messages, as they are
    assert data.examples[0]["prompt"].startswith("<|im_start|>") and "What is 1 + 2?" in data.examples[0]["prompt"]


def test_an_unscored_episode_without_a_reward_is_named(setup):  # noqa: F811
    with pytest.raises(
        AgentError,
        match=r"returned None on sample 0 \(group 0.*no --rm-type, no --custom-rm-path.*"
        r"Fix: return the reward from run_agent",
    ):
        _manager(setup, "rewardless").generate(0)


def test_user_facing_names_are_exported_and_listed_in_the_readme():
    """Item 16: a user's module imports them from rl_plugin.rollout, wherever they live; the
    README's line lists exactly them."""
    from pathlib import Path

    import rl_plugin.rollout as rollout
    from rl_plugin.rollout import Sample, append_image, generate_tokens, get_reward_value, remote_rm  # noqa: F401

    assert rollout.__all__ == ["Sample", "append_image", "generate_tokens", "get_reward_value", "remote_rm"]
    assert append_image.__module__ == "rl_plugin.rollout.vl_turns"
    assert remote_rm.__module__ == "rl_plugin.rollout.rewards.remote_rm"
    assert get_reward_value(Sample(reward={"acc": 0.5}), type("A", (), {"reward_key": "acc"})()) == 0.5
    readme = (Path(__file__).resolve().parents[4] / "README.md").read_text()
    assert f"`from rl_plugin.rollout import {', '.join(rollout.__all__)}`" in readme
