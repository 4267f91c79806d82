"""An MoE model trains end to end at expert parallelism 2 on the CPU: ``rl-plugin-train
--train-backend megatron --expert-model-parallel-size 2`` on the embedded digit-copy task with the
tiny Qwen3-MoE (``loop.embedded_setup.ensure_tiny_model(root, "qwen3_moe")``: 4 experts, top-2), two
train ranks (DP 2 = EP 2: each rank holds 2 of every layer's 4 experts), the aux and z losses on,
``--check-weight-sync`` (every expert, bitwise, or the run fails), once with the hf engine and once
with vLLM (whose CPU experts kernel needs its re-pack after each sync, ``rollout.engines.vllm_engine``).

Asserted: both runs finish their 3 rollouts, log the router losses (finite, positive), and at
step 0 the engine and the trainer agree on the sampled tokens' log-probs within
``rollout/engines/test_engines``' bound (routing that differed between engine and trainer would show here).
"""

import json
import math

import pytest

ray = pytest.importorskip("ray")

from rl_plugin.loop.embedded_setup import ensure_tiny_model  # noqa: E402
from rl_plugin.train import main  # noqa: E402
from tests.fast.rollout.engines.test_engines import MEAN_BOUND  # noqa: E402
from tests.support.local_ray import local_ray_cluster  # noqa: E402

FLAGS = [
    *("--train-backend", "megatron", "--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2"),
    *("--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"),
    *("--num-rollout", "3", "--rollout-batch-size", "8", "--check-weight-sync", "--no-progress-bar"),
    *("--eval-interval", "100"),
]
ENGINES = ("hf", "vllm")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    model = ensure_tiny_model(tmp_path_factory.mktemp("moe_model"), "qwen3_moe")
    with local_ray_cluster(tmp_path_factory.mktemp("cache")):
        out = {}
        for engine in ENGINES:
            d = tmp_path_factory.mktemp(f"moe_{engine}")
            argv = ["--hf-checkpoint", str(model), "--rollout-engine", engine, "--output-dir", str(d), *FLAGS]
            assert main(argv) == 0
            out[engine] = [
                json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if '"reward_mean"' in x
            ]
        return out


@pytest.mark.parametrize("engine", ENGINES)
def test_moe_trains_at_ep2(runs, engine):
    rows = runs[engine]
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    for r in rows:
        for name in ("moe_load_balancing_loss", "moe_z_loss"):
            assert math.isfinite(r[name]) and r[name] > 0, (name, r[name])
    assert rows[0]["rollout_log_prob_diff"] < MEAN_BOUND, rows[0]["rollout_log_prob_diff"]
