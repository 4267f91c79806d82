"""R3 end to end: ``rl-plugin-train`` on a tiny Qwen3-MoE with ``--use-rollout-routing-replay``,
the hf engine recording every token's experts and disagreeing with the trainer's routers on about
a third of the tokens (``--debug-engine-routing-flip``). The run trains (real Ray actors; the
FSDP backend, and Megatron at expert parallelism 2 over 2 ranks), every step reports ``routing/topk_agree_frac`` ~ 2/3, and the train-inference
mismatch stays at fp32 rounding (``mismatch/abs_diff_max``): the trainer ran the engine's experts.
Without R3 the same engine's rollouts differ from the trainer's log-probs by up to ~0.9 (the
unit test ``tests/fast/routing/test_r3_replay.py`` pins that on the same hook).
"""

import json
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from rl_plugin.train import main  # noqa: E402
from tests.support.local_ray import local_ray_cluster  # noqa: E402
from tests.support.tolerance import FP32_MODEL  # noqa: E402

LOGP_SCALE = 4.0  # |log-prob| of the tiny model's tokens over a 16-id vocabulary (~ -2.8), rounded up


LAYOUTS = {
    "fsdp": ["--train-backend", "fsdp"],
    "megatron_ep2": [
        "--train-backend",
        "megatron",
        "--actor-num-gpus-per-node",
        "2",
        "--expert-model-parallel-size",
        "2",
    ],
}


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    from rl_plugin.models.tiny_moe import make_tiny_moe_checkpoint
    from rl_plugin.rollout.task import DIGITS
    from rl_plugin.rollout.tokenizer import CharTokenizer

    root = tmp_path_factory.mktemp("r3_loop")
    model = make_tiny_moe_checkpoint(root / "moe", "qwen3_moe", vocab_size=16, max_position_embeddings=64)
    CharTokenizer(DIGITS).save(model)  # the embedded digit task's tokenizer
    runs = {}
    with local_ray_cluster(root / "cache"):
        for name, flags in LAYOUTS.items():
            out = root / name
            rc = main(
                [*flags, "--hf-checkpoint", str(model), "--output-dir", str(out), "--no-progress-bar"]
                + ["--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--lr", "1e-3"]
                + ["--use-rollout-routing-replay", "--debug-engine-routing-flip", "0.3333"]
            )
            rows = [json.loads(x) for x in Path(out / "metrics.jsonl").read_text().splitlines()]
            runs[name] = rc, [r for r in rows if "loss" in r]
    return runs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_r3_run_trains_with_the_engines_experts(moe_runs, layout):
    rc, steps = moe_runs[layout]
    assert rc == 0
    assert len(steps) == 2
    for row in steps:
        print({k: v for k, v in row.items() if k.startswith(("mismatch/", "routing/", "grad_norm"))})
        assert 0.45 < row["routing/topk_agree_frac"] < 0.9
        assert row["mismatch/abs_diff_max"] <= FP32_MODEL * LOGP_SCALE
        assert row["grad_norm"] > 0
