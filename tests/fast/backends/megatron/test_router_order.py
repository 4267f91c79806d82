"""The Megatron router's token order (``backends.megatron.routing_replay.to_router_order``): the
decoder's hidden states ``[s, b, H]`` flattened sequence-major, each sequence-parallel rank
holding ``s / tp`` consecutive positions (megatron-core's ``scatter_to_sequence_parallel_region``
splits dim 0). Checked against that definition written out for a few layouts; ``from_router_order``
inverts it without sequence parallelism."""

import pytest
import torch

from rl_plugin.backends.megatron.routing_replay import from_router_order, to_router_order


def _reference(local, *, bshd_rows, extra, rank, size):
    """Position (seq p, batch b) of the model input, in the [s, b] order megatron routes; the SP
    padding positions UNROUTED (-1)."""
    pad = torch.full((1, *local.shape[1:]), -1, dtype=local.dtype)
    if bshd_rows is None:
        ids = torch.cat([local, pad.expand(extra, *local.shape[1:])]) if extra else local
        grid = ids[:, None]  # [s, 1]
    else:
        rows = local.view(bshd_rows, -1, *local.shape[1:])
        if extra:
            rows = torch.cat([rows, pad[None].expand(bshd_rows, extra, *rows.shape[2:])], dim=1)
        grid = torch.stack([rows[:, p] for p in range(rows.shape[1])])  # [s, b]
    share = grid.shape[0] // size
    return grid[rank * share : (rank + 1) * share].reshape(-1, *local.shape[1:])


@pytest.mark.parametrize("bshd_rows,n,extra", [(None, 10, 0), (None, 10, 2), (3, 12, 0), (3, 12, 2)])
@pytest.mark.parametrize("size", [1, 2])
def test_router_order(bshd_rows, n, extra, size):
    local = torch.arange(n * 2).view(n, 2)  # [n_in, k]: each position's own ids
    for rank in range(size):
        got = to_router_order(local, bshd_rows=bshd_rows, extra=extra, sp_rank=rank, sp_size=size)
        assert torch.equal(got, _reference(local, bshd_rows=bshd_rows, extra=extra, rank=rank, size=size))
    if size == 1:
        routed = to_router_order(local, bshd_rows=bshd_rows, extra=0, sp_rank=0, sp_size=1)
        assert torch.equal(from_router_order(routed, bshd_rows=bshd_rows, n_in=n), local)
