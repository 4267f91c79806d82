"""Megatron checkpoints reshard across pipeline stages: saved at one PP x TP layout, resumed at
another, the next steps are the uninterrupted run's (real gloo processes, dist_checkpointing,
fp32 Adam with the distributed optimizer, linear LR decay; a tied 4-layer model, so the last
stage's copy of the embedding must come back from the embedding's one saved tensor).

    PP2 x TP1: step 1, save A, steps 2, 3   -> the uninterrupted numbers
    PP1 x TP1: load A, save B, steps 2, 3   -> = PP2 (PP2 -> PP1)
    PP2 x TP1: load B, steps 2, 3           -> = PP1 (and back: PP1 -> PP2)
    PP1 x TP2: load A, steps 2, 3           -> = PP2 (PP2 x TP1 -> PP1 x TP2)

Checked as ``test_reshard``: the loaded weights equal the saved ones bitwise (resharding only
slices; each stage saves its layers under their global layer number); the LR bitwise; the
steps' loss and grad norm within ``FP32_MODEL``, step 3's grad norm checking the restored Adam
state (see ``test_reshard``'s docstring for why that step is the sensitive one).
"""

from __future__ import annotations

import pytest
import torch

from tests.support import checkpointing
from tests.support.tolerance import FP32_MODEL, within

FLAGS = [
    "--use-distributed-optimizer",
    "--lr",
    "0.01",
    "--lr-decay-style",
    "linear",
    "--lr-decay-iters",
    "10",
    "--micro-batch-size",
    "2",
]


def _batches():
    from tests.support.megatron_common import synthetic_batch

    return [synthetic_batch(seed=s, num_prompts=2, n_per_prompt=4) for s in (1, 2, 3)]


def reshard_worker(rank, world, pp, tp, hf_dir, load_from, save_to, extra=()):
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import dp_shard, make_args

    layout = ["--pipeline-model-parallel-size", str(pp), "--tensor-model-parallel-size", str(tp), *extra]
    backend = MegatronBackend.from_args(make_args("--hf-checkpoint", hf_dir, *layout, *FLAGS, world_size=world))
    ps = backend.parallel_state
    batches = _batches()

    def step(k):
        b, groups = batches[k]
        return backend.train_step(dp_shard(b, ps.dp_size, ps.dp_rank), num_groups=groups)

    out = {}
    if load_from is None:
        step(0)
    else:
        out["meta"] = checkpointing.load(backend, load_from)
    out["weights"] = backend.export_hf_state_dict()
    if save_to:
        checkpointing.save(backend, save_to, 1, extra={"rollout_id": 1})
    out["reports"] = [step(1), step(2)]
    return out


@pytest.fixture(scope="module")
def runs(run_world, tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("mgt_reshard_pp")
    hf_dir = str(tiny_checkpoint(tie_word_embeddings=True, num_layers=4))
    a, b = str(root / "A"), str(root / "B")
    pp2 = run_world(reshard_worker, 2, 2, 1, hf_dir, None, a)[0]
    pp1 = run_world(reshard_worker, 1, 1, 1, hf_dir, a, b)[0]
    back = run_world(reshard_worker, 2, 2, 1, hf_dir, b, None)[0]
    tp2 = run_world(reshard_worker, 2, 1, 2, hf_dir, a, None)[0]
    return pp2, pp1, back, tp2


def _assert_continues(got, want):
    assert got["meta"] == {"step": 1, "extra": {"rollout_id": 1}}
    assert sorted(got["weights"]) == sorted(want["weights"])
    for name, w in want["weights"].items():
        assert torch.equal(got["weights"][name], w), name
    adv_scale = max(float(b.advantages.abs().max()) for b, _ in _batches())
    for k, (g, w) in enumerate(zip(got["reports"], want["reports"])):
        assert g["lr"] == w["lr"], k
        assert within(g["loss"], w["loss"], rtol=FP32_MODEL, scale=adv_scale), (k, g["loss"], w["loss"])
        assert within(g["grad_norm"], w["grad_norm"], rtol=FP32_MODEL), (k, g["grad_norm"], w["grad_norm"])


def test_pp2_checkpoint_resumes_at_pp1(runs):
    pp2, pp1, _, _ = runs
    _assert_continues(pp1, pp2)


def test_pp1_checkpoint_resumes_at_pp2(runs):
    _, pp1, back, _ = runs
    _assert_continues(back, pp1)


def test_pp2_tp1_checkpoint_resumes_at_pp1_tp2(runs):
    pp2, _, _, tp2 = runs
    _assert_continues(tp2, pp2)


def test_the_steps_move_the_weights(runs):
    """The comparison can fail: step 3's grad norm is not step 2's (the weights moved)."""
    pp2 = runs[0]
    assert pp2["reports"][0]["grad_norm"] != pp2["reports"][1]["grad_norm"]
