"""The RL loop end to end at pipeline parallelism: ``rl-plugin-train``'s embedded default with
``--pipeline-model-parallel-size 2 --actor-num-gpus-per-node 2`` (real Ray actors, gloo P2P
between the two stages, HF generate, ``--check-weight-sync``: the engines' weights equal the
export bit for bit after every sync), then a resume of its checkpoint at PP = 1 (DP = 2).

Run P: PP2, 2 rollouts x 2 optimizer steps, a checkpoint after each rollout. Run R: P's
checkpoint after rollout 0, loaded at PP1 x DP2 (dist_checkpointing reshards). The loaded weights
are P's bitwise, so R's rollout 1 is P's exactly (rewards, tokens), and its two steps agree with
P's within ``FP32_MODEL`` (the loss against the magnitude of its terms, the grad norm relative).
"""

import json
import shutil

import pytest

ray = pytest.importorskip("ray")

from rl_plugin.checkpoint.commit import write_tracker  # noqa: E402
from rl_plugin.train import main  # noqa: E402
from tests.support.local_ray import local_ray_cluster  # noqa: E402
from tests.support.tolerance import FP32_MODEL, within  # noqa: E402

FLAGS = [
    "--train-backend",
    "megatron",
    "--rollout-batch-size",
    "4",
    "--n-samples-per-prompt",
    "4",
    "--global-batch-size",
    "8",
    "--micro-batch-size",
    "2",
    "--num-rollout",
    "2",
    "--actor-num-gpus-per-node",
    "2",
    "--check-weight-sync",
    "--save-interval",
    "1",
    "--no-progress-bar",
    "--lr",
    "1e-3",
]


def _run(out, *extra):
    return main(["--output-dir", str(out), "--save", str(out / "ckpt"), *FLAGS, *extra])


def _steps(path):
    return [r for r in (json.loads(x) for x in open(path).read().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory):
    with local_ray_cluster(tmp_path_factory.mktemp("cache")):
        p = tmp_path_factory.mktemp("pp2")
        assert _run(p, "--pipeline-model-parallel-size", "2") == 0
        r = tmp_path_factory.mktemp("resume_pp1")
        shutil.copytree(p / "ckpt", r / "ckpt")
        write_tracker(r / "ckpt", 2)  # after rollout 0
        assert _run(r, "--load", str(r / "ckpt")) == 0
        yield p, r


def test_pp2_trains_and_syncs(pp2_run):
    steps = _steps(pp2_run[0] / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0 and r["num_micro_batches"] == 4 for r in steps)  # 8 samples / 2, DP = 1
    assert len({r["loss"] for r in steps}) > 1  # the weights move between steps


def test_pp2_checkpoint_resumes_at_pp1(pp2_run):
    p, r = pp2_run
    want = [x for x in _steps(p / "metrics.jsonl") if x["step"] > 2]
    got = _steps(r / "metrics.jsonl")
    assert [x["step"] for x in got] == [3, 4]
    for g, w in zip(got, want):
        for key in ("reward_mean", "reward_max", "response_len_mean", "tokens", "samples_seen", "lr"):
            assert g[key] == w[key], key
        scale = max(abs(w["advantage_max"]), abs(w["advantage_min"])) * max(1.0, abs(w["old_log_prob"]))
        assert within(g["loss"], w["loss"], rtol=FP32_MODEL, scale=scale), (g["loss"], w["loss"])
        assert within(g["grad_norm"], w["grad_norm"], rtol=FP32_MODEL), (g["grad_norm"], w["grad_norm"])
