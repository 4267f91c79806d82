"""The loss core's autograd-aware collectives (``rl_plugin.loss.comm``) on a real gloo world: the
sum all-reduce and the CP gather return the full values and, as J is the sum of every rank's
contribution, their backward gives each rank the sum of all ranks' upstream gradients."""

from __future__ import annotations

import torch

from rl_plugin.cp import all_rank_layouts
from rl_plugin.loss.comm import all_reduce_sum, gather_responses
from rl_plugin.parallel import ParallelState

TOTAL, RESP = torch.tensor([7, 4, 9]), torch.tensor([5, 1, 6])


def _collectives(rank, world):
    ps = ParallelState.from_world(cp=2)
    x = torch.tensor([1.0, 2.0], dtype=torch.float64) * (rank + 1)
    x.requires_grad_(True)
    s = all_reduce_sum(x, ps.cp_group)
    (s * (rank + 1)).sum().backward()  # rank r's contribution weighs the sum by r + 1
    full = torch.arange(int(RESP.sum()), dtype=torch.float64) * 0.5
    layouts = all_rank_layouts(TOTAL, RESP, cp_size=2, qkv_format="thd")
    local = full[layouts[rank].resp_index].clone().requires_grad_(True)
    gathered = gather_responses(local, layouts, rank, ps.cp_group)
    w = torch.linspace(-1, 1, full.numel(), dtype=torch.float64)
    (gathered * w * (rank + 1)).sum().backward()
    return (
        s.tolist(),
        x.grad.tolist(),
        torch.equal(gathered.detach(), full),
        torch.equal(local.grad, 3 * w[layouts[rank].resp_index]),
        layouts[rank].resp_index.numel(),
    )


def test_all_reduce_sum_and_gather_with_their_backward(run_world):
    out = run_world(_collectives, 2)
    for sums, grad, gathered_is_full, grad_is_summed, _ in out:
        assert sums == [3.0, 6.0] and grad == [3.0, 3.0]  # forward x_0 + x_1; backward (1 + 2) per element
        assert gathered_is_full and grad_is_summed
    assert out[0][4] + out[1][4] == int(RESP.sum()) and min(out[0][4], out[1][4]) > 0  # each rank owns a share


def test_without_a_group_they_are_the_identity():
    x = torch.tensor([1.0, 2.0])
    assert all_reduce_sum(x, None) is x
    (layout,) = all_rank_layouts(TOTAL, RESP, cp_size=1)
    local = torch.arange(12.0)
    assert layout.resp_index.tolist() == list(range(12))  # one CP rank owns every response token, in order
    assert torch.equal(gather_responses(local, [layout], 0, None), local)
