"""Uneven data-parallel shards on the Megatron backend: DP ranks with different micro-batch counts,
and a DP rank with no sample at all, still apply exactly the DP=1 gradient. The cancel factor is
each rank's own micro-batch count times DP (``step.cancel_factor``), so counts need not match.

Tolerance: ``tolerance.FP32_MODEL``; J against the magnitude of its per-token terms (GSPO:
-A * s_i with s_i = exp(mean log-ratio), whose rounding scales with |logp|), the grad norm relative."""

from __future__ import annotations

import tempfile

from tests.support.flags import EXACT_SGD
from tests.support.tolerance import FP32_MODEL, within

SIZES = ((1, 3), (1, 1))  # (prompts, samples per prompt): 3 samples -> [2, 1]; 1 sample -> [1, 0]


def _worker(rank, world, hf_dir):
    import torch

    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import dp_shard, make_args, synthetic_batch, with_old_log_probs

    backend = MegatronBackend.from_args(
        make_args(
            "--hf-checkpoint",
            hf_dir,
            *EXACT_SGD,
            "--micro-batch-size",
            "1",
            "--advantage-estimator",
            "gspo",
            world_size=world,
        )
    )
    obj = [tempfile.mkdtemp(prefix="mgt_uneven_") if rank == 0 else None]
    torch.distributed.broadcast_object_list(obj, src=0)
    backend.save_checkpoint(obj[0], step=0)
    out = []
    for prompts, n in SIZES:
        backend.load_checkpoint(obj[0])
        batch, groups = synthetic_batch(seed=21, num_prompts=prompts, n_per_prompt=n, old_noise=0.3)
        local = dp_shard(batch, world, rank)
        logp = backend.compute_log_probs(local)
        local = with_old_log_probs(local, logp)
        report = backend.train_step(local, num_groups=groups)
        scale = float(batch.advantages.abs().max()) * max(1.0, float(logp.abs().max()) if logp.numel() else 0.0)
        out.append((local.num_samples, report["loss"], report["grad_norm"], report["num_micro_batches"], scale))
    return out


def test_uneven_dp_shards_match_dp1(run_world, tiny_qwen2):
    hf_dir = tiny_qwen2
    ref = run_world(_worker, 1, hf_dir)[0]
    dp2 = run_world(_worker, 2, hf_dir)
    assert [r[0] for r in dp2[0]] == [2, 1] and [r[0] for r in dp2[1]] == [1, 0]  # the shapes under test
    for case in range(len(SIZES)):
        for rank_out in dp2:
            _, loss, norm, _, _ = rank_out[case]
            scale = ref[case][4]  # DP=1: the whole batch's log-probs
            assert within(loss, ref[case][1], rtol=FP32_MODEL, scale=scale), (case, loss, ref[case])
            assert within(norm, ref[case][2], rtol=FP32_MODEL), (case, norm, ref[case])
