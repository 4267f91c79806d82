"""One packed layout's attention plan (``rl_plugin.backends.megatron.compat.local_attention.PackedGrid``):
the block-diagonal causal mask, and the padded form's index tensors against the plain
advanced-index pad / transpose / boolean unpad they replace. (The attention itself, both forms,
outputs and gradients: ``test_packed_attention.py``.)"""

from __future__ import annotations

import torch

from rl_plugin.backends.megatron.compat.local_attention import PackedGrid
from rl_plugin.cp import segment_grid

CU = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
CPU = torch.device("cpu")


def test_dense_mask_masks_other_samples_and_the_future():
    mask = PackedGrid(CU, CPU).dense_mask()
    assert mask.shape == (1, 1, 6, 6)
    sees = (~mask[0, 0]).int().tolist()
    assert sees == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ]


def test_pad_plan_is_the_plain_pad_and_unpad():
    grid = PackedGrid(CU, CPU)
    width, samples, pad_index, unpad_index, causal = grid.pad_plan()
    assert (width, samples) == (3, 3)
    x = torch.arange(6 * 2, dtype=torch.float32).view(6, 2)  # [t, features]
    gather, valid = segment_grid(CU)
    plain = x[gather].transpose(0, 1)  # [L, S, features]
    lean = x.index_select(0, pad_index).view(width, samples, 2)
    assert torch.equal(lean[valid.t()], plain[valid.t()])  # every real slot holds its token
    assert torch.equal(lean.reshape(width * samples, 2).index_select(0, unpad_index), plain.transpose(0, 1)[valid])
    assert torch.equal(lean.reshape(width * samples, 2).index_select(0, unpad_index), x)  # back in packed order
    assert causal[0, 0].tolist() == [[False, True, True], [False, False, True], [False, False, False]]
    assert grid.pad_plan()[2] is pad_index  # built once per layout


def test_matches_by_values_and_device():
    grid = PackedGrid(CU, CPU)
    assert grid.matches(CU, CPU) and grid.matches(CU.clone(), CPU)
    assert not grid.matches(torch.tensor([0, 3, 5, 6], dtype=torch.int32), CPU)
    assert not grid.matches(CU, torch.device("meta"))
    assert (
        PackedGrid(torch.tensor([0, 9, 18, 26]), CPU).padded and not PackedGrid(torch.tensor([0, 100, 101]), CPU).padded
    )
