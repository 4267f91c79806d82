"""Routing replay end to end: ``rl-plugin-train`` on a tiny Qwen3-MoE, real Ray actors, Megatron.

- R3 (``--use-rollout-routing-replay``) at expert parallelism 2 over 2 ranks: the hf engine records
  every token's experts and disagrees with the trainer's routers on about a third of the tokens
  (``--debug-engine-routing-flip``). The run trains, every step reports ``routing/topk_agree_frac``
  ~ 2/3, and the train-inference mismatch stays at fp32 rounding (``mismatch/abs_diff_max``): the
  trainer ran the engine's experts. Without R3 the same engine's log-probs differ from the
  trainer's by up to ~0.9 (``tests/fast/routing/test_r3_replay.py`` pins that on the same hook,
  and the FSDP backend's replay).
- R2 (``--use-routing-replay``, two optimizer steps in one rollout): the train actor's old pass
  records the trainer's routing and both steps replay it.
"""

import json
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from rl_plugin.train import main  # noqa: E402
from tests.support.local_ray import local_ray_cluster  # noqa: E402
from tests.support.tolerance import FP32_MODEL  # noqa: E402

LOGP_SCALE = 4.0  # |log-prob| of the tiny model's tokens over a 16-id vocabulary (~ -2.8), rounded up


R3 = ["--use-rollout-routing-replay", "--debug-engine-routing-flip", "0.3333", "--num-rollout", "2"]
RUNS = {
    "megatron_ep2": [
        "--train-backend",
        "megatron",
        "--actor-num-gpus-per-node",
        "2",
        "--expert-model-parallel-size",
        "2",
        *R3,
    ],
    # R2: two optimizer steps in one rollout, so the old pass runs apart, records, and both steps replay it
    "megatron_r2": ["--train-backend", "megatron", "--use-routing-replay", "--num-rollout", "1"]
    + ["--global-batch-size", "8", "--micro-batch-size", "4"],
}


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    from rl_plugin.models.tiny import make_tiny_moe_checkpoint
    from rl_plugin.rollout.data.task import DIGITS
    from rl_plugin.rollout.data.tokenizer import CharTokenizer

    root = tmp_path_factory.mktemp("r3_loop")
    model = make_tiny_moe_checkpoint(root / "moe", "qwen3_moe", vocab_size=16, max_position_embeddings=64)
    CharTokenizer(DIGITS).save(model)  # the embedded digit task's tokenizer
    runs = {}
    with local_ray_cluster(root / "cache"):
        for name, flags in RUNS.items():
            out = root / name
            rc = main(
                [*flags, "--hf-checkpoint", str(model), "--output-dir", str(out), "--no-progress-bar"]
                + ["--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--lr", "1e-3"]
            )
            rows = [json.loads(x) for x in Path(out / "metrics.jsonl").read_text().splitlines()]
            runs[name] = rc, [r for r in rows if "loss" in r]
    return runs


def test_r3_run_trains_with_the_engines_experts(moe_runs):
    rc, steps = moe_runs["megatron_ep2"]
    assert rc == 0
    assert len(steps) == 2
    for row in steps:
        print({k: v for k, v in row.items() if k.startswith(("mismatch/", "routing/", "grad_norm"))})
        assert 0.45 < row["routing/topk_agree_frac"] < 0.9
        assert row["mismatch/abs_diff_max"] <= FP32_MODEL * LOGP_SCALE
        assert row["grad_norm"] > 0


def test_r2_run_replays_the_old_pass_routing(moe_runs):
    """The rollout's first step runs on the old pass's weights: replaying its routing, the
    routers agree everywhere; the second, one update later, still replays the old routing."""
    rc, steps = moe_runs["megatron_r2"]
    assert rc == 0
    assert [r["step_in_rollout"] for r in steps] == [0, 1]
    for row in steps:
        print({k: v for k, v in row.items() if k.startswith(("routing/", "grad_norm", "step"))})
        frac = row["routing/topk_agree_frac"]
        if row["step_in_rollout"] == 0:
            assert frac == 1.0
        else:
            assert 0.5 < frac <= 1.0
        assert row["grad_norm"] > 0
