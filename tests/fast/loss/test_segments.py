"""Segment sums and per-token repeats (the reducers' building blocks) equal their definitions,
empty samples included (NumPy's reduceat alone would misread them); so do the segment id of
each token (``cp.segment_ids``) and the block-causal mask of packed samples both backends use
(``backends.attention_mask.block_causal_mask``)."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.backends.attention_mask import block_causal_mask
from rl_plugin.cp import segment_ids
from rl_plugin.loss.segments import repeat_per_token, segment_sum


@pytest.mark.parametrize("lengths", [[3, 0, 5, 1, 0], [0, 0], [2, 2], [0, 4, 0], [], [1]])
def test_segment_sum_and_repeat_match_definitions(lengths):
    g = torch.Generator().manual_seed(len(lengths))
    lens = torch.tensor(lengths, dtype=torch.long)
    v = torch.randn(int(lens.sum()), generator=g, dtype=torch.float64)
    sid = torch.repeat_interleave(torch.arange(len(lengths)), lens)
    want = torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, sid, v)
    got = segment_sum(v, lens)
    assert got.dtype == torch.float64 and got.shape == want.shape and float((got - want).abs().sum()) < 1e-14
    got32 = segment_sum(v.float(), lens)  # fp32: a sum of <= 5 terms of size ~1, within 8 ulp
    assert got32.dtype == torch.float32
    assert float((got32.double() - want).abs().sum()) <= len(lengths) * 8 * 2**-23 * 5
    per_sample = torch.randn(len(lengths), generator=g, dtype=torch.float64)
    assert torch.equal(repeat_per_token(per_sample, lens, int(lens.sum())), per_sample[sid])


@pytest.mark.parametrize("lengths", [[3, 0, 5, 1, 0], [0, 0], [2, 2], [0, 4, 0], [], [1]])
def test_segment_ids_and_block_causal_mask_match_definitions(lengths):
    """Reference: token t belongs to the sample whose run holds it; a may attend to b iff the
    same sample holds both and b <= a (written as loops over the runs and over token pairs)."""
    lens = torch.tensor(lengths, dtype=torch.long)
    owner = [i for i, n in enumerate(lengths) for _ in range(n)]
    assert segment_ids(lens).tolist() == owner
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lens, 0).int()])
    t = len(owner)
    want = [[owner[a] == owner[b] and b <= a for b in range(t)] for a in range(t)]
    got = block_causal_mask(cu, t)
    assert got.dtype == torch.bool and got.tolist() == (want if t else [])


def test_block_causal_mask_refuses_a_row_of_another_length():
    with pytest.raises(ValueError, match="packed row has 6 tokens but cu_seqlens covers 5"):
        block_causal_mask(torch.tensor([0, 2, 5]), 6)
