"""--ci-test's weight-sync checks end to end (embedded default, Megatron, the hf engine, real Ray
actors): a weight sync that leaves the engine on its old weights (the test double of
``rl_plugin.ray.testing_hooks``, ``StaleReceiver``) stops the run at the rollout whose generate
loaded that sync (sync 2: rollout 1), with one line naming the check, the rollout and both values: the engine's
weight version and the trainer's when it kept its version, the first tensor and both fingerprints
when it claims the new version over the old weights."""

import json
import re

import pytest

ray = pytest.importorskip("ray")

from rl_plugin.ray.testing_hooks import STALE_ENGINE_ENV  # noqa: E402
from rl_plugin.train import main  # noqa: E402
from tests.support.local_ray import local_ray_cluster  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    with local_ray_cluster(tmp_path_factory.mktemp("cache")):
        yield


def _run(out):
    argv = ["--train-backend", "megatron", "--output-dir", str(out), "--num-rollout", "4", "--no-progress-bar"]
    return main([*argv, "--ci-test"])


def _trained(out):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return sorted({r["rollout_id"] for r in rows if "loss" in r})


@pytest.mark.parametrize(
    "hook, line",
    [
        (
            "2",
            "error: ci-test: weight version: rollout 1: rollout engine 0 holds weight version 1, the trainer's is 2: "
            "the engine did not load the sync",
        ),
        (
            "2:weights",
            r"error: ci-test: weight-sync fingerprint: rollout 1: rollout engine 0: --check-weight-sync: rollout "
            r"weights differ from the trainer's at '[^']+' \(sha256 [0-9a-f]{12} vs [0-9a-f]{12}\): the weight sync "
            r"is broken",
        ),
    ],
    ids=["version", "weights"],
)
def test_an_engine_left_on_the_old_weights_stops_the_run_at_that_rollout(
    ray_cluster, tmp_path, capsys, monkeypatch, hook, line
):
    monkeypatch.setenv(STALE_ENGINE_ENV, hook)
    assert _run(tmp_path) == 1
    lines = [x for x in capsys.readouterr().err.splitlines() if "ci-test:" in x]
    assert len(lines) == 1, lines
    assert re.fullmatch(line, lines[0]) if hook.endswith("weights") else lines[0] == line, lines[0]
    # sync 1 is the start-up's full sync; rollout 0's train call publishes sync 2, which rollout 1's
    # generate loads first: the run stops there, before rollout 1 trains
    assert _trained(tmp_path) == [0]
