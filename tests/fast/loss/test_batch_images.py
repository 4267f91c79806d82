"""A step batch's images (model inputs of a vision-language model): selected with their samples,
checked for agreement, carried through pickling."""

from __future__ import annotations

import pickle

import pytest
import torch

from rl_plugin.loss import StepBatch
from rl_plugin.loss.errors import BadBatchError


def _batch() -> StepBatch:
    # 3 samples with 1, 0 and 2 images; grids of 4, 8 and 2 patches; pixel row p holds value p
    grids = torch.tensor([[1, 2, 2], [1, 2, 4], [1, 1, 2]])
    return StepBatch(
        tokens=torch.arange(12),
        total_lengths=torch.tensor([4, 3, 5]),
        response_lengths=torch.tensor([1, 1, 2]),
        loss_mask=torch.ones(4),
        advantages=torch.zeros(4),
        group_ids=torch.tensor([0, 0, 1]),
        pixel_values=torch.arange(14, dtype=torch.float32)[:, None].repeat(1, 3),
        image_grid_thw=grids,
        image_counts=torch.tensor([1, 0, 2]),
    ).validate()


def test_select_gathers_each_samples_images_and_patches():
    sub = _batch().select(torch.tensor([2, 0]))
    assert sub.image_counts.tolist() == [2, 1]
    assert sub.image_grid_thw.tolist() == [[1, 2, 4], [1, 1, 2], [1, 2, 2]]
    assert sub.pixel_values[:, 0].tolist() == list(range(4, 14)) + [0, 1, 2, 3]
    empty = _batch().select(torch.tensor([1]))
    assert empty.image_counts.tolist() == [0] and empty.pixel_values.shape == (0, 3)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(image_counts=torch.tensor([1, 0])), "image_counts needs 3 entries"),
        (dict(image_counts=torch.tensor([1, 1, 2])), "3 grids for 4 images"),
        (dict(pixel_values=torch.zeros(13, 3)), "13 pixel rows for 14 patches"),
    ],
)
def test_disagreeing_images_are_refused(change, message):
    b = _batch()
    for k, v in change.items():
        setattr(b, k, v)
    with pytest.raises(BadBatchError, match=message):
        b.validate()


def test_images_survive_pickling():
    b = pickle.loads(pickle.dumps(_batch()))
    assert torch.equal(b.pixel_values, _batch().pixel_values) and b.image_counts.tolist() == [1, 0, 2]
