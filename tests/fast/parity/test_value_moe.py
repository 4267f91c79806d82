"""The Megatron value model of a mixture-of-experts model (issue 47): expert parallelism changes
where the experts live, not the critic's step.

At DP = 2 on the tiny Qwen3-MoE, EP = 2 gives EP = 1's value loss, grad norm and weight update
(exact SGD at lr 1: the update IS the applied gradient) and the same forward-only values. The 9
samples split 5 / 4 over DP and ``--micro-batch-size 2`` gives the ranks 3 and 2 micro-batches, so
at EP = 2 the second rank runs one idle pass of the VALUE model (``step.idle_forward`` with
``values``: hidden states, no LM head), which must add exactly nothing. The export of the MoE
value model names every expert as the causal LM's, plus ``score.weight``.

Tolerance: ``tolerance.FP32_MODEL`` (the all-to-all reorders the experts' inputs).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tests.support.flags import EXACT_SGD
from tests.support.tolerance import FP32_MODEL


def _worker(rank, world, ep, hf_dir):
    from tests.support.megatron_common import dp_shard, synthetic_batch
    from tests.support.megatron_value import seeded_head, value_backend

    backend = value_backend(
        hf_dir, "--micro-batch-size", "2", "--expert-model-parallel-size", str(ep), *EXACT_SGD, world_size=world
    )
    seeded_head(backend, seed=2, scale=0.5)
    batch, num_groups = synthetic_batch(seed=3, num_prompts=3, n_per_prompt=3)
    g = torch.Generator().manual_seed(9)
    n = batch.loss_mask.shape[0]
    noise, returns = 0.3 * torch.randn(n, generator=g), 3.0 * torch.randn(n, generator=g)
    ps = backend.parallel_state  # global draws, then this DP rank's share: every layout sees the same numbers
    local = dp_shard(replace(batch, values=noise, returns=returns), ps.dp_size, ps.dp_rank)
    w0 = backend.export_hf_state_dict()
    old = backend.compute_values(local)
    report = backend.value_train_step(replace(local, values=old + local.values), num_groups=num_groups)
    w1 = backend.export_hf_state_dict()
    olds = [None] * world
    torch.distributed.all_gather_object(olds, old)
    return (report, {k: w1[k] - w0[k] for k in w0}, torch.cat(olds)) if rank == 0 else None


@pytest.fixture(scope="module")
def results(run_world, tmp_path_factory):
    from rl_plugin.models.tiny import make_tiny_moe_checkpoint

    hf_dir = str(make_tiny_moe_checkpoint(tmp_path_factory.mktemp("value_ep") / "qwen3_moe", "qwen3_moe", seed=7))
    return {ep: run_world(_worker, 2, ep, hf_dir)[0] for ep in (1, 2)}


def test_expert_parallel_value_step_is_ep1s(results):
    (r1, u1, v1), (r2, u2, v2) = results[1], results[2]
    assert torch.allclose(v2, v1, rtol=FP32_MODEL, atol=FP32_MODEL * float(v1.abs().max()))
    assert abs(r2["value_loss"] - r1["value_loss"]) <= FP32_MODEL * abs(r1["value_loss"])
    assert abs(r2["grad_norm"] - r1["grad_norm"]) <= FP32_MODEL * r1["grad_norm"]
    assert sorted(u1) == sorted(u2) and "score.weight" in u1 and "lm_head.weight" not in u1
    assert any(".mlp.experts." in k for k in u1)
    num = math.sqrt(sum(float(((u2[k] - u1[k]) ** 2).sum()) for k in u1))
    den = math.sqrt(sum(float((u1[k] ** 2).sum()) for k in u1))
    assert num / den < FP32_MODEL, num / den
    assert float(u1["score.weight"].abs().max()) > 1e-3 and r1["num_micro_batches"] == 3
