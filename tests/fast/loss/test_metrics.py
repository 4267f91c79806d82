"""Metrics over DP x CP: a rank with no data contributes the identity (-inf / +inf), never 0;
sample-mean diagnostics equal the single-process values; the CP gather is differentiable."""

from __future__ import annotations

import torch

from rl_plugin.cp import all_rank_layouts
from rl_plugin.loss import LossConfig, StepBatch, prepare_step
from rl_plugin.loss.comm import gather_responses
from rl_plugin.parallel import ParallelState
from tests.support.tolerance import FP64, within

ADV = [-3.0, -1.0, 0.5, 2.0]  # all negative advantages live on rank 0 in the test below


def _batch(sample_range):
    total = torch.tensor([4, 5, 3, 6])
    resp = torch.tensor([2, 3, 1, 4])
    sid = torch.repeat_interleave(torch.arange(4), resp)
    adv = torch.tensor(ADV, dtype=torch.float64)[sid]
    full = StepBatch(
        tokens=torch.arange(int(total.sum())),
        total_lengths=total,
        response_lengths=resp,
        loss_mask=torch.ones(int(resp.sum()), dtype=torch.float64),
        advantages=adv,
        group_ids=torch.tensor([0, 0, 1, 1]),
        old_log_probs=torch.full((int(resp.sum()),), -1.0, dtype=torch.float64),
    )
    return full.select(torch.tensor(sample_range, dtype=torch.long))


def _metrics_worker(rank, world, ranges):
    ps = ParallelState.from_world(tp=1, cp=1, dp=world)
    batch = _batch(ranges[rank])
    ctx = prepare_step(batch, LossConfig(pg_metrics="with_entropy"), ps, num_groups=2)
    if batch.num_samples:
        mb = ctx.micro_batch(torch.arange(batch.num_samples))
        logp = torch.full((mb.num_local_tokens,), -1.0, dtype=torch.float64)
        ctx.loss(logp, torch.full_like(logp, 0.5), mb)
    return ctx.finish()


def test_empty_rank_does_not_spoil_max_min_and_means(run_world):
    single = run_world(_metrics_worker, 1, [[0, 1, 2, 3]])[0]
    # rank 1 holds only the positive-advantage samples, rank 2 holds nothing at all
    for report in run_world(_metrics_worker, 3, [[0, 1], [2, 3], []]):
        assert report["advantage_max"] == 2.0 and report["advantage_min"] == -3.0
        # fp64 sums over ranks in another order, of terms of magnitude <= max|advantage|
        for key in ("loss", "pg_loss", "ratio_mean", "entropy", "advantage_mean", "samples", "tokens", "ratio_sum"):
            assert within(report[key], single[key], rtol=FP64, scale=max(map(abs, ADV))), key
    assert (
        within(single["ratio_mean"], 1.0, rtol=FP64)
        and within(single["entropy"], 0.5, rtol=FP64)
        and single["samples"] == 4.0
    )
    assert within(
        single["advantage_mean"], sum(ADV) / 4, rtol=FP64, scale=max(map(abs, ADV))
    )  # sample mean, not token mean
    assert single["tokens"] == 10.0 and single["ratio_sum"] == 10.0 and single["ratio_sq_sum"] == 10.0


def _gather_worker(rank, world):
    ps = ParallelState.from_world(tp=1, cp=world, dp=1)
    total, resp = [7, 5, 9], [3, 1, 4]
    layouts = all_rank_layouts(total, resp, cp_size=world, qkv_format="thd")
    x = torch.arange(8, dtype=torch.float64)
    local = x[layouts[rank].resp_index].clone().requires_grad_(True)
    full = gather_responses(local, layouts, rank, ps.cp_group)
    weights = torch.arange(1, 9, dtype=torch.float64)
    (full * weights).sum().backward()  # every CP rank adds the same full term: grad = world x w
    return full.detach(), local.grad, weights[layouts[rank].resp_index] * world


def test_cp_gather_round_trip_and_gradient(run_world):
    for full, grad, want in run_world(_gather_worker, 2):
        assert torch.equal(full, torch.arange(8, dtype=torch.float64))
        assert torch.equal(grad, want)
