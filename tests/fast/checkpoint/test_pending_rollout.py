"""The rollout generated ahead, kept in a checkpoint (``rl_plugin.checkpoint.pending_rollout``): it
reads back bitwise, with its id and lag; a checkpoint without one reads as None; a pending rollout
refuses to stand in for another rollout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl_plugin.checkpoint import pending_rollout as pr
from rl_plugin.checkpoint.layout import step_dir
from rl_plugin.errors import LoopError


def _data():
    g = torch.Generator().manual_seed(0)
    return pr.RolloutData(  # the rollout type the module saves
        tokens=torch.randint(0, 50, (9,), generator=g),
        total_lengths=torch.tensor([5, 4]),
        response_lengths=torch.tensor([3, 2]),
        rollout_log_probs=-torch.rand(5, generator=g, dtype=torch.float64),
        rewards=torch.tensor([1.0, -0.5]),
        group_ids=torch.tensor([0, 0]),
        num_groups=1,
        stats={"rollout/x": 0.25},
        loss_mask=torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0]),
    )


def test_round_trip_is_bitwise(tmp_path):
    directory = Path(step_dir(tmp_path, 4))
    directory.mkdir()
    pending = pr.PendingRollout(rollout_id=5, data=_data(), staleness=1)
    pr.write_pending_rollout(directory, pending)
    back = pr.read_pending_rollout(tmp_path, 4)
    assert (back.rollout_id, back.staleness) == (5, 1)
    for name in (
        "tokens",
        "total_lengths",
        "response_lengths",
        "rollout_log_probs",
        "rewards",
        "group_ids",
        "loss_mask",
    ):
        a, b = getattr(back.data, name), getattr(pending.data, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert back.data.num_groups == 1 and back.data.stats == {"rollout/x": 0.25}
    assert [p.name for p in directory.iterdir()] == [pr.PENDING_ROLLOUT]  # the .tmp was renamed into place
    assert pr.read_pending_rollout(tmp_path, 3) is None  # a checkpoint without one


def test_data_for_refuses_another_rollout():
    pending = pr.PendingRollout(rollout_id=5, data=_data(), staleness=1)
    assert pending.data_for(5) is pending.data
    with pytest.raises(LoopError, match="the rollout generated ahead is rollout 5, the loop is at rollout 6"):
        pending.data_for(6)


def test_a_vl_rollouts_images_round_trip_bitwise(tmp_path):
    """Issue 46: an overlapped or preempted VL run trains on the saved rollout after a resume, so
    the file keeps every sample's pixels and grid (two images, none, one) and ``select_groups``
    still finds each sample's images after the load."""
    g = torch.Generator().manual_seed(1)
    grid = torch.tensor([[1, 2, 2], [1, 4, 2], [1, 2, 4]])
    images = dict(
        pixel_values=torch.randn(int(grid.prod(dim=1).sum()), 1176, generator=g),
        image_grid_thw=grid,
        image_counts=torch.tensor([2, 0, 1]),
    )
    data = pr.RolloutData(
        tokens=torch.randint(0, 50, (12,), generator=g),
        total_lengths=torch.tensor([5, 4, 3]),
        response_lengths=torch.tensor([2, 2, 1]),
        rollout_log_probs=-torch.rand(5, generator=g),
        rewards=torch.tensor([1.0, 0.0, 1.0]),
        group_ids=torch.tensor([0, 0, 1]),
        num_groups=2,
        **images,
    )
    directory = Path(step_dir(tmp_path, 2))
    directory.mkdir()
    pr.write_pending_rollout(directory, pr.PendingRollout(rollout_id=3, data=data, staleness=1))
    back = pr.read_pending_rollout(tmp_path, 2).data
    for name, want in images.items():
        got = getattr(back, name)
        assert got is not None and got.dtype == want.dtype and torch.equal(got, want), name
    last = back.select_groups(torch.tensor([2]), group_size=1)  # sample 2 alone
    assert torch.equal(last.image_grid_thw, grid[2:]) and torch.equal(
        last.pixel_values, images["pixel_values"][12:]
    )  # after 4 + 8 patches
