"""Megatron checkpoints reshard: saved at one TP x DP layout, resumed at another, the next step is
the uninterrupted run's (real gloo processes, megatron-core dist_checkpointing, fp32, Adam with
the distributed optimizer, linear LR decay).

    TP2 x DP1: step 1, save A, step 2 (+ step 3)    -> the uninterrupted numbers
    TP1 x DP2: load A, save B, step 2 (+ step 3)    -> = TP2 x DP1 (TP -> DP resharding)
    TP1 x DP1: load B, step 2 (+ step 3)            -> = TP1 x DP2 (DP2 -> DP1)

Checked: the loaded weights equal the saved ones bitwise (resharding only slices); the LR equals
bitwise (scheduler state); step 2's loss and grad norm agree within ``FP32_MODEL`` (the same
math reordered by another layout: tests/support/tolerance.py), J against the magnitude of its terms
(|advantage| x ratio, ratio ~1, so S = max |advantage|), the grad norm relative (a sum of squares,
nothing cancels). Step 3's grad norm, taken at weights moved by step 2's Adam update, checks
the optimizer state the load restored (moments, step count): skipping the optimizer load moves
it by 1e-2 relative, while each layout's step agrees to ~1e-7 (the next step's loss and grad norm
alone do not depend on optimizer state, and the loss at ratio 1 not even on the weights). Also:
the per-rank ``.pt`` checkpoints of earlier versions and FSDP checkpoints are refused by name and
leave the model untouched, and so is a checkpoint of another model (the first tensor whose global
shape differs is named).
"""

from __future__ import annotations

from pathlib import Path

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


def _worker(rank, world, tp, hf_dir, load_from, save_to, refuse_dir, other_hf_dir=None):
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import dp_shard, make_args

    if other_hf_dir:  # a checkpoint of another model (wider MLP), for the refusal below
        other = MegatronBackend.from_args(make_args("--hf-checkpoint", other_hf_dir, *FLAGS, world_size=world))
        checkpointing.save(other, Path(refuse_dir) / "other_model", 1)
        del other
    backend = MegatronBackend.from_args(
        make_args("--hf-checkpoint", hf_dir, "--tensor-model-parallel-size", str(tp), *FLAGS, world_size=world)
    )
    ps = backend.parallel_state
    batches = _batches()

    def step(k):
        b, groups = batches[k]
        return backend.train_step(dp_shard(b, ps.dp_size, ps.dp_rank), num_groups=groups)

    out = {}
    if refuse_dir:
        before = backend.export_hf_state_dict()
        out["refused"] = {}
        for name in ("old_format", "fsdp", "other_model"):
            try:
                checkpointing.load(backend, Path(refuse_dir) / name)
            except ValueError as e:
                out["refused"][name] = str(e)
        after = backend.export_hf_state_dict()
        out["untouched"] = all(torch.equal(before[k], after[k]) for k in before)
    if load_from is None:
        step(0)
    else:
        out["meta"] = checkpointing.load(backend, load_from)
    out["weights"] = backend.export_hf_state_dict()
    if save_to:
        checkpointing.save(backend, save_to, 1, extra={"rollout_id": 1})
    out["reports"] = [step(1), step(2)]
    return out


def _old_and_fsdp_dirs(root: Path) -> Path:
    old = root / "old_format"  # the per-rank format under the loop: iter_N/latest + iter_N/iter_N/rank_*.pt
    (old / "iter_0000001" / "iter_0000001").mkdir(parents=True)
    torch.save({"step": 1}, old / "iter_0000001" / "iter_0000001" / "rank_00000.pt")
    (old / "iter_0000001" / "latest").write_text("1")
    (old / "latest_checkpointed_iteration.txt").write_text("1\n")
    fsdp = root / "fsdp" / "iter_0000001"
    fsdp.mkdir(parents=True)
    torch.save({"step": 1, "extra": {}}, fsdp / "meta.pt")
    (root / "fsdp" / "latest_checkpointed_iteration.txt").write_text("1\n")
    return root


@pytest.fixture(scope="module")
def runs(run_world, tiny_checkpoint, tiny_qwen2, tmp_path_factory):
    root = tmp_path_factory.mktemp("mgt_reshard")
    hf_dir = tiny_qwen2
    a, b = str(root / "A"), str(root / "B")
    tp2 = run_world(_worker, 2, 2, hf_dir, None, a, None)
    dp2 = run_world(_worker, 2, 1, hf_dir, a, b, None)
    other = tiny_checkpoint(intermediate_size=96)
    dp1 = run_world(_worker, 1, 1, hf_dir, b, None, str(_old_and_fsdp_dirs(root / "refuse")), other)
    return tp2[0], dp2[0], dp1[0], (a, b)


def _assert_continues(got, want):
    assert got["meta"] == {"step": 1, "extra": {"rollout_id": 1}}
    for name, w in want["weights"].items():
        assert torch.equal(got["weights"][name], w), name  # resharding slices, never recomputes
    adv_scale = max(float(b.advantages.abs().max()) for b, _ in _batches())
    for k, (g, w) in enumerate(zip(got["reports"], want["reports"])):
        assert g["lr"] == w["lr"], k
        assert within(g["loss"], w["loss"], rtol=FP32_MODEL, scale=adv_scale), (k, g["loss"], w["loss"])
        assert within(g["grad_norm"], w["grad_norm"], rtol=FP32_MODEL), (k, g["grad_norm"], w["grad_norm"])


def test_tp2_checkpoint_resumes_at_tp1_dp2(runs):
    tp2, dp2, _, _ = runs
    _assert_continues(dp2, tp2)


def test_dp2_checkpoint_resumes_at_dp1(runs):
    _, dp2, dp1, _ = runs
    _assert_continues(dp1, dp2)


def test_checkpoint_is_atomic_layout(runs):
    """What --load reads: the tracker and a complete iter_* directory, no staging left behind."""
    for root in runs[3]:
        assert (Path(root) / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
        assert sorted(p.name for p in Path(root).iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
        assert (Path(root) / "iter_0000001" / "metadata.json").exists()


def test_old_formats_are_refused_untouched(runs):
    _, _, dp1, _ = runs
    assert dp1["untouched"]
    assert (
        "per-rank .pt format" in dp1["refused"]["old_format"] and "nothing was loaded" in dp1["refused"]["old_format"]
    )
    assert "FSDP backend" in dp1["refused"]["fsdp"] and "--train-backend fsdp" in dp1["refused"]["fsdp"]
    other = dp1["refused"]["other_model"]
    assert "holds another model than --hf-checkpoint" in other and "Fix: pass the --hf-checkpoint" in other
    assert "mlp.linear_fc1.weight is (" in other and "in the checkpoint and (" in other  # the first tensor that differs
