"""``one_rank_collectives``: megatron-core's grad-norm and DDP grad all-reduces are skipped exactly
where they are the identity (a synchronous SUM / MAX / MIN over a one-rank group, outside a
coalescing block, or in a synchronous block over a one-rank group), and reduce as before
everywhere else. Two gloo ranks: each has its own one-rank group and the WORLD."""

from __future__ import annotations

import torch


def _worker(rank, world):
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.optimizer import clip_grads

    from rl_plugin.backends.megatron.compat import one_rank_collectives as orc
    from rl_plugin.backends.megatron.compat.cpu_shim import apply_cpu_shim

    apply_cpu_shim()  # as the backend does first: megatron's grad norm allocates on "cuda"
    singles = [dist.new_group([r]) for r in range(world)]  # collective: every rank builds both
    mine = singles[rank]
    orc.install()
    orc.install()  # idempotent
    skip = {
        "sum_one_rank": orc.is_identity_all_reduce(dist.ReduceOp.SUM, mine, False),
        "max_one_rank": orc.is_identity_all_reduce(dist.ReduceOp.MAX, mine, False),
        "async_one_rank": orc.is_identity_all_reduce(dist.ReduceOp.SUM, mine, True),
        "avg_one_rank": orc.is_identity_all_reduce(dist.ReduceOp.AVG, mine, False),
        "sum_world": orc.is_identity_all_reduce(dist.ReduceOp.SUM, None, False),
    }
    with dist.distributed_c10d._coalescing_manager(mine):
        skip["sum_one_rank_coalescing"] = orc.is_identity_all_reduce(dist.ReduceOp.SUM, mine, False)
    t = torch.tensor([1.0 + rank])
    clip_grads.torch.distributed.all_reduce(t, group=mine)  # skipped: unchanged
    one = t.clone()
    clip_grads.torch.distributed.all_reduce(t)  # the world: summed as before
    # The DDP grad sync's coalescing block: nothing to coalesce over one rank, torch's over the world.
    coalesced = {}
    for name, group in (("one_rank", mine), ("world", None)):
        x = torch.tensor([1.0 + rank])
        with pgb._coalescing_manager(group, async_ops=False) as cm:
            pgb.torch.distributed.all_reduce(x, group=group)
        coalesced[name] = (type(cm).__name__, x)
    norm = clip_grads.get_grad_norm_fp32([torch.full((3,), 2.0 + rank)], grad_stats_parallel_group=mine)
    return {
        "skip": skip,
        "one": one,
        "world": t,
        "norm": norm,
        "coalesced": coalesced,
        "wrapped": clip_grads.torch.distributed.all_reduce is orc.all_reduce
        and clip_grads.torch.zeros(1).shape == (1,),
    }


def test_only_identity_all_reduces_are_skipped(run_world):
    for rank, out in enumerate(run_world(_worker, 2)):
        assert out["skip"] == {
            "sum_one_rank": True,
            "max_one_rank": True,
            "async_one_rank": False,
            "avg_one_rank": False,
            "sum_world": False,
            "sum_one_rank_coalescing": False,
        }
        assert out["wrapped"]
        (kind_one, one), (kind_world, world) = out["coalesced"]["one_rank"], out["coalesced"]["world"]
        assert kind_one == "_Nothing" and torch.equal(one, torch.tensor([1.0 + rank]))
        assert kind_world == "_CoalescingManager" and torch.equal(world, torch.tensor([3.0]))
        assert torch.equal(out["one"], torch.tensor([1.0 + rank]))
        assert torch.equal(out["world"], torch.tensor([3.0]))
        # this rank's own grad norm, sqrt(3 * (2 + rank)^2), never the other rank's (fp32 sqrt of an
        # exact sum of squares: within a few ulp)
        assert abs(out["norm"] - 3**0.5 * (2.0 + rank)) < 1e-5 * (2.0 + rank)
