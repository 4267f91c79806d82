"""The global per-step counts (``rl_plugin.loss.counts``) against hand counts: samples, (fractional)
tokens, groups with an all-masked one, per-sample M_i; the refusals naming the sample; and DP = 2
(one all-reduce) equal to one process."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.loss.counts import check_loss_mask, counts_of, sample_token_counts
from rl_plugin.loss.errors import BadBatchError
from rl_plugin.parallel import ParallelState

RESP = torch.tensor([3, 0, 2, 1])  # sample 1 has an empty response
MASK = torch.tensor([1.0, 0.5, 0.0, 1.0, 1.0, 0.0])  # sample 3's only token is masked
GROUPS = torch.tensor([0, 0, 1, 2])


def test_counts_of_one_process():
    c = counts_of(MASK, RESP, GROUPS, ParallelState.single(), num_groups=3)
    assert c.num_samples == 4 and c.total_tokens == 3.5 and c.num_groups == 3  # group 2 all masked still counts
    assert c.sample_tokens.dtype == torch.float64 and c.sample_tokens.tolist() == [1.5, 0.0, 2.0, 0.0]
    assert c.group_samples.tolist() == [2.0, 1.0, 1.0] and c.group_tokens.tolist() == [1.5, 2.0, 0.0]
    wider = counts_of(MASK, RESP, GROUPS, ParallelState.single(), num_groups=5)
    assert wider.num_groups == 3 and wider.group_samples.tolist() == [2.0, 1.0, 1.0, 0.0, 0.0]  # empty ids don't count
    assert counts_of(MASK, RESP, GROUPS, ParallelState.single()).group_samples.numel() == 3  # found by MAX


def test_sample_token_counts_of_bool_and_fractional_masks():
    assert sample_token_counts(MASK.bool(), RESP).tolist() == [2.0, 0.0, 2.0, 0.0]
    third = torch.full((3,), 1 / 3, dtype=torch.float64)
    assert sample_token_counts(third, torch.tensor([3])).item() == float(third.sum())  # never rounded


def test_refusals_name_the_sample():
    with pytest.raises(BadBatchError, match=r"sample 3: group_id 3 >= num_groups 3 \(ids are step-local\)"):
        counts_of(MASK, RESP, torch.tensor([0, 0, 1, 3]), ParallelState.single(), num_groups=3)
    with pytest.raises(BadBatchError, match="empty step: no sample on any data-parallel rank"):
        counts_of(
            torch.zeros(0),
            torch.zeros(0, dtype=torch.long),
            torch.zeros(0, dtype=torch.long),
            ParallelState.single(),
            1,
        )
    with pytest.raises(BadBatchError, match=r"sample 2: loss_mask\[1\] = -0.5; a loss mask must be finite and >= 0"):
        check_loss_mask(torch.tensor([1.0, 1, 1, 1, -0.5, 1]), RESP)
    with pytest.raises(BadBatchError, match=r"sample 0: loss_mask\[0\] = inf"):
        check_loss_mask(torch.tensor([float("inf"), 1, 1, 1, 1, 1]), RESP)
    assert check_loss_mask(torch.ones(6, dtype=torch.long), RESP) is None  # integer masks are 0/1 by type


def _dp_counts(rank, world):
    ps = ParallelState.from_world(dp=2)
    mine = [0, 1] if rank == 0 else [2, 3]  # group 0 on rank 0, groups 1 and 2 on rank 1
    starts = [0, 3, 3, 5]
    resp = RESP[mine]
    mask = torch.cat([MASK[starts[i] : starts[i] + int(RESP[i])] for i in mine])
    c = counts_of(mask, resp, GROUPS[mine], ps)  # num_groups found by the MAX all-reduce
    return c.num_samples, c.total_tokens, c.num_groups, c.group_samples.tolist(), c.group_tokens.tolist()


def test_two_dp_ranks_count_the_step_as_one_process(run_world):
    one = counts_of(MASK, RESP, GROUPS, ParallelState.single())
    want = (one.num_samples, one.total_tokens, one.num_groups, one.group_samples.tolist(), one.group_tokens.tolist())
    assert run_world(_dp_counts, 2) == [want, want]
