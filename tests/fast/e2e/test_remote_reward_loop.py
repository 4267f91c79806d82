"""Issue 27 part 4 end to end: ``rl-plugin-train`` (the embedded default, 2 rollouts) with
``--rm-type remote_rm --rm-url`` against a real HTTP server on 127.0.0.1 that scores like the
embedded task's reward (digit_match). The rollout actor (its own process) POSTs every sample; the
server records its answers, and each rollout's ``reward_mean`` in metrics.jsonl is the mean of
exactly the answers the server gave that rollout (the loop is synchronous: rollout k's requests
all precede rollout k+1's), and ``eval/reward_mean`` the mean of the held-out ones after them.
A server that starts failing mid-run stops the run naming the URL."""

import json

import pytest

ray = pytest.importorskip("ray")

from rl_plugin.rollout.rewards.functions import digit_match  # noqa: E402
from rl_plugin.train import main  # noqa: E402
from tests.support.local_ray import local_ray_cluster  # noqa: E402
from tests.support.reward_server import RewardServer  # noqa: E402

BATCH, N, ROLLOUTS = 4, 4, 2


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    with local_ray_cluster(tmp_path_factory.mktemp("cache")):
        yield


def _argv(url, out):
    size = ["--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N), "--num-rollout", str(ROLLOUTS)]
    batches = ["--global-batch-size", str(BATCH * N), "--micro-batch-size", str(BATCH * N)]
    remote = ["--rm-type", "remote_rm", "--rm-url", url, "--rm-max-concurrency", "4", "--rm-max-retries", "1"]
    return [*remote, *size, *batches, "--output-dir", str(out), "--no-progress-bar"]


def test_remote_rewards_are_what_the_run_trains_on(ray_cluster, tmp_path):
    with RewardServer(lambda p: {"reward": digit_match(p["prompt"], p["response"], p["label"])}) as server:
        assert main(_argv(server.url, tmp_path / "o")) == 0
    rows = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval/reward_mean" in r]
    answers = [a["reward"] for _, a in server.answers]
    per = BATCH * N
    assert len(train) == ROLLOUTS and len(evals) == 1
    assert server.requests == len(answers) == ROLLOUTS * per + 64  # + the 64 held-out prompts, one sample each
    for k, row in enumerate(train):
        chunk = answers[k * per : (k + 1) * per]
        assert row["reward_mean"] == pytest.approx(sum(chunk) / per, abs=1e-6)
        assert row["samples"] == per
    held_out = answers[ROLLOUTS * per :]
    assert evals[0]["eval/reward_mean"] == pytest.approx(sum(held_out) / len(held_out), abs=1e-6)
    assert server.max_in_flight <= 4
    prompts = {p["prompt"] for p, _ in server.answers[:per]}
    assert len(prompts) == BATCH and all(p.endswith("=") for p in prompts)  # the embedded task's prompts


def test_a_server_that_fails_mid_run_stops_it_naming_the_url(ray_cluster, tmp_path, capsys):
    """Up at start-up (the probe passes), then every answer an HTTP 503: the first rollout stops
    the run with the scorer's line (URL, status, sample), not a hang or a retry of the engine."""
    with RewardServer(fail_first=10**6, fail_status=503) as server:
        assert main(_argv(server.url, tmp_path / "o")) != 0
    err = capsys.readouterr().err
    assert f"RemoteRewardError: --rm-url {server.url}: the reward server failed on sample" in err
    assert "after 2 attempts (--rm-max-retries 1): HTTP 503" in err
