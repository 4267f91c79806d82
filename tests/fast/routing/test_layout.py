"""A micro-batch's routed experts in its model input's order (``rl_plugin.routing.layout``): the
gather by input index with padding left to the trainer's router, the mask of the tokens the
agreement counts, and the counter."""

from __future__ import annotations

import torch

from rl_plugin.routing.layout import (
    UNROUTED,
    AgreementCounter,
    local_routed_experts,
    own_where_unrouted,
    pad_experts,
    routed_response_mask,
)

# two samples: (prompt 2, response 3), (prompt 1, response 2): 8 tokens
TOTAL, RESP = torch.tensor([5, 3]), torch.tensor([3, 2])
ROUTED = torch.arange(8 * 2 * 2, dtype=torch.int16).view(8, 2, 2)  # [tokens, layers, k]


def test_pad_and_gather_by_input_index():
    pad = pad_experts(3, 2, 2)
    assert pad.dtype == torch.int16 and pad.shape == (3, 2, 2) and bool((pad == UNROUTED).all())
    index = torch.tensor([[5, 6, 7, -1], [0, 1, -1, -1]])  # bshd rows, padded
    got = local_routed_experts(index, ROUTED)
    assert got.shape == (8, 2, 2) and got.dtype == torch.int16
    assert torch.equal(got[0], ROUTED[5]) and torch.equal(got[4], ROUTED[0]) and torch.equal(got[5], ROUTED[1])
    assert bool((got[[3, 6, 7]] == UNROUTED).all())
    assert local_routed_experts(index, None) is None


def test_the_routers_own_choice_fills_only_unrouted_rows():
    target = torch.tensor([[3, 1], [-1, -1], [0, 2]], dtype=torch.int16)
    own = torch.tensor([[0, 1], [2, 3], [1, 0]])
    assert own_where_unrouted(target, own).tolist() == [[3, 1], [2, 3], [0, 2]]


def test_routed_response_mask_counts_every_response_token_but_the_last():
    thd = torch.arange(8)
    # sample 0: positions 2, 3 (its last, 4, is not run); sample 1: position 1 (global 6; 7 is its last)
    assert routed_response_mask(TOTAL, RESP, thd).tolist() == [False, False, True, True, False, False, True, False]
    cp_chunk = torch.tensor([3, -1, 6, 0])  # another layout: some padding, another order
    assert routed_response_mask(TOTAL, RESP, cp_chunk).tolist() == [True, False, True, False]


def test_agreement_counter_sums_over_micro_batches():
    c = AgreementCounter()
    c.add(torch.tensor([True, False, True]), torch.tensor([True, True, False]))
    c.add(torch.tensor([True, True]), torch.tensor([True, True]))
    assert (c.agree, c.total) == (3, 4)
