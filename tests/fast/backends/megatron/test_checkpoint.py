"""--save / --load: save at step k, load into a freshly built backend, run steps k+1, k+2:
identical (bitwise) to the uninterrupted run. DP=2, Adam with a decaying LR; bf16 and fp32, with
and the distributed optimizer, so the (sharded) optimizer state, the fp32 main params, the
LR schedule and the RNG all have to come back. (The plain optimizer's resume is exercised by every
case of backends/megatron/test_parity, which reloads a checkpoint and must match exactly.)"""

from __future__ import annotations

import pytest
import torch

from tests.support import checkpointing


def _worker(rank, world, hf_dir, ckpt_dir, precision_flags=("--bf16", "--use-distributed-optimizer")):
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import dp_shard, make_args, synthetic_batch

    flags = [
        "--hf-checkpoint",
        hf_dir,
        *precision_flags,
        "--lr",
        "0.01",
        "--lr-decay-style",
        "linear",
        "--lr-decay-iters",
        "10",
        "--micro-batch-size",
        "2",
    ]
    batches = [synthetic_batch(seed=s, num_prompts=2, n_per_prompt=4) for s in (1, 2, 3)]

    def step(backend, k):
        b, groups = batches[k]
        return backend.train_step(dp_shard(b, world, rank), num_groups=groups)

    a = MegatronBackend.from_args(make_args(*flags, world_size=world))
    step(a, 0)
    checkpointing.save(a, ckpt_dir, 1, extra={"data_position": 17})
    after_save = a.export_hf_state_dict()
    uninterrupted = [step(a, 1), step(a, 2)]
    final_a = a.export_hf_state_dict()

    b = MegatronBackend.from_args(make_args(*flags, world_size=world))
    fresh_differs = any(not torch.equal(v, after_save[k]) for k, v in b.export_hf_state_dict().items())
    meta = checkpointing.load(b, ckpt_dir)
    loaded_equal = all(torch.equal(v, after_save[k]) for k, v in b.export_hf_state_dict().items())
    resumed = [step(b, 1), step(b, 2)]
    final_b = b.export_hf_state_dict()
    return {
        "meta": meta,
        "fresh_differs": fresh_differs,
        "loaded_equal": loaded_equal,
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "final_equal": all(torch.equal(final_a[k], final_b[k]) for k in final_a),
    }


@pytest.mark.parametrize(
    "precision_flags", [("--bf16", "--use-distributed-optimizer"), ("--use-distributed-optimizer",)]
)
def test_resume_continues_identical_trajectory(run_world, tiny_qwen2, tmp_path, precision_flags):
    """Regression for the distributed optimizer: its load shares one Adam ``step`` tensor across
    parameters (see ``checkpoint._unalias_step_tensors``); fp32 + distopt needs no_grad copies."""
    hf_dir = tiny_qwen2
    for out in run_world(_worker, 2, hf_dir, str(tmp_path / "ckpt"), precision_flags):
        assert out["meta"] == {"step": 1, "extra": {"data_position": 17}}
        assert out["fresh_differs"] and out["loaded_equal"]
        for u, r in zip(out["uninterrupted"], out["resumed"]):
            for key in ("loss", "grad_norm", "lr", "pg_clipfrac"):
                assert u[key] == r[key], (key, u[key], r[key])
        assert out["final_equal"]
        assert out["uninterrupted"][0]["lr"] != out["uninterrupted"][1]["lr"]  # the schedule moves


def _missing_worker(rank, world, hf_dir, path):
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import make_args

    backend = MegatronBackend.from_args(make_args("--hf-checkpoint", hf_dir))
    try:
        checkpointing.load(backend, path)
    except FileNotFoundError as e:
        return str(e)
    return None


def test_load_from_empty_directory_names_the_flag(run_world, tiny_qwen2, tmp_path):
    hf_dir = tiny_qwen2
    msg = run_world(_missing_worker, 1, hf_dir, str(tmp_path / "empty"))[0]
    assert msg is not None and "--load" in msg and "latest" in msg
