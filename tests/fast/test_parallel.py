"""``ParallelState`` (``rl_plugin.parallel``): its consistency checks, Megatron's rank order in
``from_world`` (a real gloo world of 4), and ``virtual_pipeline_size``'s arithmetic and refusals."""

from __future__ import annotations

import pytest

from rl_plugin.errors import RLArgumentError
from rl_plugin.parallel import ParallelState, virtual_pipeline_size


def test_single_and_its_checks():
    ps = ParallelState.single()
    assert (ps.dp_size, ps.cp_size, ps.tp_size, ps.pp_size) == (1, 1, 1, 1) and ps.is_last_stage
    assert not ParallelState(pp_size=2, pp_rank=0, pp_group=object(), pp_cpu_group=object()).is_last_stage
    with pytest.raises(ValueError, match=r"tp_rank=2 is outside \[0, tp_size=2\)"):
        ParallelState(tp_size=2, tp_rank=2, tp_group=object())
    with pytest.raises(ValueError, match="cp_size=2 > 1 needs a cp_group"):
        ParallelState(cp_size=2, dp_cp_group=object())
    with pytest.raises(ValueError, match="dp_size \\* cp_size > 1 needs a dp_cp_group"):
        ParallelState(dp_size=2, dp_group=object())
    with pytest.raises(ValueError, match="pp_size=2 > 1 needs a pp_group and a pp_cpu_group"):
        ParallelState(pp_size=2, pp_group=object())


def _coords(rank, world):
    import torch.distributed as dist

    ps = ParallelState.from_world(tp=2, cp=1)
    sizes = tuple(dist.get_world_size(g) if g is not None else 1 for g in (ps.tp_group, ps.dp_group, ps.dp_cp_group))
    return (ps.tp_rank, ps.cp_rank, ps.dp_rank, ps.dp_size, sizes)


def test_from_world_orders_tp_fastest_then_cp_then_dp(run_world):
    # rank = tp_rank + tp * (cp_rank + cp * dp_rank) with tp 2, cp 1, dp 2
    assert run_world(_coords, 4) == [
        (0, 0, 0, 2, (2, 2, 2)),
        (1, 0, 0, 2, (2, 2, 2)),
        (0, 0, 1, 2, (2, 2, 2)),
        (1, 0, 1, 2, (2, 2, 2)),
    ]


@pytest.mark.parametrize(
    "layers, pp, per_chunk, per_rank, want",
    [(8, 2, 2, None, 2), (8, 2, 1, None, 4), (12, 2, None, 3, 3), (8, 2, None, None, None)],
)
def test_virtual_pipeline_size(layers, pp, per_chunk, per_rank, want):
    assert virtual_pipeline_size(layers, pp, layers_per_chunk=per_chunk, chunks_per_rank=per_rank) == want


@pytest.mark.parametrize(
    "layers, pp, per_chunk, per_rank, message",
    [
        (
            8,
            1,
            2,
            None,
            "--num-layers-per-virtual-pipeline-stage 2 with --pipeline-model-parallel-size 1: the interleaved",
        ),
        (
            8,
            2,
            3,
            None,
            "8 layers do not split evenly into 2 stages x equal chunks of that size. Fix: use --num-layers-per-virtual-pipeline-stage with one of 1, 2 (4 layers per stage)",
        ),
        (12, 2, None, 4, "Fix: use --num-virtual-stages-per-pipeline-rank with one of 2, 3, 6 (6 layers per stage)"),
        (8, 2, 4, None, "that is one chunk of 4 layers per stage, the plain 1F1B schedule"),
        (9, 2, 1, None, "Fix: use a --pipeline-model-parallel-size that divides 9 into stages of 2 layers or more"),
    ],
    ids=["one_stage", "uneven_chunks", "uneven_stages", "one_chunk", "uneven_layers"],
)
def test_virtual_pipeline_refusals_name_the_sizes_that_work(layers, pp, per_chunk, per_rank, message):
    with pytest.raises(RLArgumentError) as err:
        virtual_pipeline_size(layers, pp, layers_per_chunk=per_chunk, chunks_per_rank=per_rank)
    assert message in str(err.value)
