"""The remote reward model (``--rm-type remote_rm``) against a real HTTP server on 127.0.0.1
(``tests.support.reward_server``): the rewards are the server's answers, the concurrency bound
holds on the server's side, failures are retried and then named (URL, status or exception,
sample), and a server that is down is named by the start-up probe, before Ray starts."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from rl_plugin.configs import RolloutConfig
from rl_plugin.errors import RLArgumentError
from rl_plugin.loop.preflight import check_reward_server
from rl_plugin.rollout.rewards.remote_rm import RemoteRewardError, probe, remote_rm, shared_client
from rl_plugin.rollout.rewards.scorer import SampleScorer
from rl_plugin.rollout.sample import Sample
from tests.support.reward_server import RewardServer, free_port


def _args(url, **kw):
    base = dict(rm_type="remote_rm", custom_rm_path=None, rm_url=url, rm_max_concurrency=None, rm_timeout=None)
    base.update(rm_max_retries=None, group_rm=False, reward_key=None, n_samples_per_prompt=2)
    base.update(kw)
    return argparse.Namespace(**base)


def _samples(n):
    return [
        Sample(index=i, group_index=i // 2, prompt=f"p{i}", response="x" * i, label=str(i), metadata={"i": i})
        for i in range(n)
    ]


def _score(payload):
    """Numbers for even labels, {"reward": x, ...} for odd ones; x depends on every field."""
    x = len(payload["response"]) / 10 + payload["metadata"]["i"] + (payload["prompt"] == f"p{payload['label']}")
    return x if int(payload["label"]) % 2 == 0 else {"reward": x, "detail": "odd"}


def test_rewards_are_the_servers_answers():
    samples = _samples(6)
    with RewardServer(_score) as server:
        out = SampleScorer(_args(server.url)).score_samples(samples)
    assert out == [i / 10 + i + 1 for i in range(6)]
    assert [s.reward for s in samples[:2]] == [1.0, {"reward": 2.1, "detail": "odd"}]  # a dict is kept whole
    payload = server.answers[0][0]
    assert set(payload) == {"prompt", "response", "label", "metadata"}
    assert server.requests == 6


def test_reward_key_and_a_bad_answer_name_the_sample():
    samples = _samples(3)
    with RewardServer(lambda p: {"score": 0.5} if p["label"] != "2" else "n/a") as server:
        with pytest.raises(ValueError) as err:
            SampleScorer(_args(server.url, reward_key="score")).score_samples(samples)
        msg = str(err.value)
        assert f"--rm-url {server.url} returned 'n/a' for sample 2 (prompt 'p2')" in msg
        with pytest.raises(ValueError, match=r"a dict without the key 'reward' for sample 0 \(prompt 'p0'\)"):
            SampleScorer(_args(server.url)).score_samples(samples)
        assert SampleScorer(_args(server.url, reward_key="score")).score_samples(samples[:2]) == [0.5, 0.5]


def test_concurrency_bound_holds_on_the_server():
    with RewardServer(lambda p: 1.0, delay=0.05) as server:
        out = SampleScorer(_args(server.url, rm_max_concurrency=3)).score_samples(_samples(18))
    assert out == [1.0] * 18 and server.requests == 18
    assert 1 < server.max_in_flight <= 3  # concurrent, and never past the bound


def test_a_user_rm_awaiting_slimes_remote_rm_keeps_the_concurrency_bound(tmp_path):
    """Issue 37 #10: slime's pattern, a --custom-rm-path rm that calls its own server through
    remote_rm(args, sample) reading args.rm_url. Every call shares the process's one client, so the
    server never holds more than --rm-max-concurrency requests (before: a client per call, all 18 at
    once; and --rm-url with --custom-rm-path was refused at parse time)."""
    from rl_plugin.arguments import parse_args

    rm = tmp_path / "my_rm.py"
    rm.write_text(
        "from rl_plugin.rollout.rewards.remote_rm import remote_rm\n\n"
        "async def rm(args, sample):\n"
        "    assert args.rm_url.endswith('/reward')\n"
        "    return 2 * (await remote_rm(args, sample))\n"
    )
    with RewardServer(lambda p: int(p["label"]) / 10, delay=0.05) as server:
        flags = ["--custom-rm-path", f"{rm}:rm", "--rm-url", server.url, "--rm-max-concurrency", "3"]
        args = parse_args(flags)  # refused before the fix ("--rm-url without --rm-type remote_rm")
        scorer = SampleScorer(RolloutConfig.from_args(args), user_args=args)
        out = scorer.score_samples(_samples(18))
        assert out == [2 * i / 10 for i in range(18)] and server.requests == 18
        assert 1 < server.max_in_flight <= 3, server.max_in_flight  # concurrent, and never past the bound
        # the same client serves the run's scorer of --rm-type remote_rm with these settings
        remote = parse_args(["--rm-type", "remote_rm", "--rm-url", server.url, "--rm-max-concurrency", "3"])
        assert SampleScorer(RolloutConfig.from_args(remote)).remote is shared_client(RolloutConfig.from_args(args))
    with pytest.raises(RemoteRewardError, match=r"remote_rm\(args, sample\) was called without --rm-url"):
        asyncio.run(remote_rm(parse_args(["--custom-rm-path", f"{rm}:rm"]), _samples(1)[0]))


def test_a_500_is_retried_then_succeeds():
    with RewardServer(lambda p: 0.25, fail_first=2) as server:
        scorer = SampleScorer(_args(server.url, rm_max_retries=2))
        assert scorer.score_samples(_samples(1)) == [0.25]
    assert server.requests == 3 and scorer.remote.retries == 2


def test_a_client_error_is_not_retried_and_is_named():
    with RewardServer(lambda p: 0.25, fail_first=1, fail_status=400) as server:
        with pytest.raises(RemoteRewardError) as err:
            SampleScorer(_args(server.url, rm_max_retries=3)).score_samples(_samples(1))
    assert server.requests == 1
    msg = str(err.value)
    assert f"--rm-url {server.url}" in msg and "HTTP 400: 'server busy'" in msg and "sample 0" in msg
    assert "prompt 'p0'" in msg and "after 1 attempt " in msg


def test_retries_exhausted_name_url_status_and_sample():
    with RewardServer(lambda p: 0.25, fail_first=100, fail_status=503) as server:
        with pytest.raises(RemoteRewardError) as err:
            SampleScorer(_args(server.url, rm_max_retries=1)).score_samples(_samples(1))
    msg = str(err.value)
    assert "after 2 attempts (--rm-max-retries 1): HTTP 503" in msg and f"--rm-url {server.url}" in msg
    assert server.requests == 2


def test_a_dead_server_fails_loud_with_the_url():
    url = f"http://127.0.0.1:{free_port()}/reward"
    with pytest.raises(RemoteRewardError) as err:
        SampleScorer(_args(url, rm_max_retries=1)).score_samples(_samples(2))
    msg = str(err.value)
    assert msg.startswith(f"--rm-url {url}: the reward server failed on sample ")
    assert "ClientConnectorError" in msg and "after 2 attempts" in msg and "Fix:" in msg


def test_a_hanging_server_times_out_with_the_url():
    with RewardServer(hang=True) as server:
        with pytest.raises(RemoteRewardError) as err:
            SampleScorer(_args(server.url, rm_timeout=0.3, rm_max_retries=0)).score_samples(_samples(1))
    msg = str(err.value)
    assert f"--rm-url {server.url}" in msg and "timed out after 0.3 s (--rm-timeout)" in msg and "prompt 'p0'" in msg


def test_awaitable_path_and_no_loop_blocking():
    with RewardServer(lambda p: 0.5) as server:
        scorer = SampleScorer(_args(server.url))
        assert asyncio.run(scorer.score(_samples(2))) == [0.5, 0.5]

        async def inside_a_loop():
            with pytest.raises(RuntimeError, match=r"await scorer.score\(samples\)"):
                scorer.score_samples(_samples(1))

        asyncio.run(inside_a_loop())


def test_start_up_probe_names_a_dead_server():
    url = f"http://127.0.0.1:{free_port()}/reward"
    assert "cannot connect to 127.0.0.1" in probe(url)
    with pytest.raises(RLArgumentError) as err:
        check_reward_server(url)
    assert f"--rm-url {url}" in str(err.value) and "not reachable" in str(err.value)
    with RewardServer() as server:
        assert probe(server.url) is None
        check_reward_server(server.url)
        assert server.requests == 0  # the probe scores nothing


def test_trainer_refuses_a_dead_server_before_ray(monkeypatch, tmp_path, capsys):
    import ray

    from rl_plugin.train import main

    def forbidden(*a, **k):
        raise AssertionError("the check ran after Ray started")

    monkeypatch.setattr(ray, "init", forbidden)
    monkeypatch.setenv("RL_PLUGIN_CACHE", str(tmp_path / "cache"))
    url = f"http://127.0.0.1:{free_port()}/reward"
    argv = [
        "--train-backend",
        "fsdp",
        "--no-progress-bar",
        "--num-rollout",
        "1",
        "--rm-type",
        "remote_rm",
        "--rm-url",
        url,
    ]
    assert main([*argv, "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"--rm-url {url}" in err and "not reachable" in err and "Fix:" in err


def test_concurrent_score_calls_share_the_bound():
    """A generate hook may score sample by sample as they finish: the bound is the scorer's."""
    with RewardServer(lambda p: 1.0, delay=0.05) as server:
        scorer = SampleScorer(_args(server.url, rm_max_concurrency=2))

        async def one_by_one():
            return await asyncio.gather(*(scorer.score([s]) for s in _samples(8)))

        assert asyncio.run(one_by_one()) == [[1.0]] * 8
    assert server.requests == 8 and 1 < server.max_in_flight <= 2
