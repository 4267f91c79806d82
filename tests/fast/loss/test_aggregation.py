"""Single-process aggregation API: the formulas, the constant-loss property, no NaN on empty
samples/groups, and bad data raising with the sample named."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_plugin.loss import AGGREGATION_MODES, BadBatchError, LossConfig, StepBatch, aggregate, prepare_step
from rl_plugin.parallel import ParallelState
from tests.support import reference as ref
from tests.support.tolerance import FP64, within


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=8),
    # |c| >= 1e-300 or 0: c times a weight (>= 1/48) stays a normal fp64 number; below ~1e-306 it
    # underflows to subnormals, whose rounding is absolute (5e-324), not relative to |c|
    c=st.one_of(st.just(0.0), st.floats(1e-300, 5), st.floats(-5, -1e-300)),
    seed=st.integers(0, 2**16),
)
def test_constant_loss_gives_c_for_sample_token_prompt_mean(lengths, c, seed):
    """For constant per-token loss c: sample_mean = token_mean = prompt_mean = c (docs/design.md),
    as long as at least one sample has an unmasked token (else every mode is 0)."""
    g = torch.Generator().manual_seed(seed)
    r = sum(lengths)
    mask = (torch.rand(r, generator=g) > 0.3).double()
    groups = torch.randint(0, 3, (len(lengths),), generator=g)
    x = torch.full((r,), c, dtype=torch.float64)
    sid = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    per_sample = (
        torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, sid, mask)
        if r
        else torch.zeros(len(lengths), dtype=torch.float64)
    )
    for mode in ("sample_mean", "token_mean", "prompt_mean"):
        j = float(aggregate(x, mask, lengths, mode, group_ids=groups))
        if mode == "token_mean":
            want = c if float(mask.sum()) > 0 else 0.0
        elif mode == "sample_mean":
            want = c * float((per_sample > 0).double().mean())
        else:
            gsum = torch.zeros(3, dtype=torch.float64).index_add_(0, groups, per_sample)
            present = (
                torch.zeros(3, dtype=torch.float64).index_add_(0, groups, torch.ones(len(lengths), dtype=torch.float64))
                > 0
            )
            want = c * float((gsum[present] > 0).double().mean())
        assert within(j, want, rtol=FP64, scale=abs(c)), (mode, j, want)  # fp64 sums of terms of magnitude |c|
        if float(per_sample.min()) > 0:  # no empty sample: c in every mode, up to fp64 rounding
            assert within(j, c, rtol=FP64)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_matches_naive_formula(mode):
    g = torch.Generator().manual_seed(1)
    lengths = [3, 0, 5, 1, 4, 2]
    r = sum(lengths)
    x = torch.randn(r, generator=g, dtype=torch.float64)
    mask = (torch.rand(r, generator=g) > 0.25).double()
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    got = aggregate(x, mask, lengths, mode, group_ids=groups, divisor=4.0)
    want = ref.objective(x, mask, lengths, groups, mode, 4.0)
    assert within(got, want, rtol=FP64, scale=float(x.abs().max()))  # fp64 sums in another order


def test_empty_samples_and_all_masked_step_are_zero_not_nan():
    x = torch.randn(6, dtype=torch.float64)
    mask = torch.zeros(6, dtype=torch.float64)
    for mode in AGGREGATION_MODES:
        j = aggregate(x, mask, [2, 4], mode, group_ids=[0, 1], divisor=3.0)
        assert float(j) == 0.0
    # an empty sample counts in N and contributes 0
    mask = torch.tensor([1, 1, 0, 0, 0, 0], dtype=torch.float64)
    x = torch.ones(6, dtype=torch.float64)
    assert float(aggregate(x, mask, [2, 4], "sample_mean")) == 0.5
    # an all-masked group counts in P and contributes 0
    assert float(aggregate(x, mask, [2, 4], "prompt_mean", group_ids=[0, 1])) == 0.5


def test_aggregate_rejects_bad_divisor_and_shapes():
    x = torch.ones(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="finite divisor > 0"):
        aggregate(x, torch.ones(3), [3], "constant")
    with pytest.raises(ValueError, match="finite divisor > 0"):
        aggregate(x, torch.ones(3), [3], "constant", divisor=float("inf"))
    with pytest.raises(ValueError, match="response_lengths sum to 4"):
        aggregate(x, torch.ones(3), [4], "sample_mean")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(x, torch.ones(3), [3], "seq_mean")


def _batch(**over):
    base = dict(
        tokens=torch.arange(12),
        total_lengths=torch.tensor([5, 4, 3]),
        response_lengths=torch.tensor([2, 3, 1]),
        loss_mask=torch.ones(6),
        advantages=torch.zeros(6),
        group_ids=torch.tensor([0, 0, 1]),
    )
    base.update(over)
    return StepBatch(**base)


def test_bad_data_names_the_sample():
    ps, cfg = ParallelState.single(), LossConfig()
    adv = torch.zeros(6)
    adv[4] = float("nan")
    with pytest.raises(BadBatchError, match=r"sample 1: advantages\[2\] = nan"):
        prepare_step(_batch(advantages=adv), cfg, ps)
    with pytest.raises(
        BadBatchError, match="loss_mask has 5 entries but response_lengths sum to 6: the tensor ends inside sample 2"
    ):
        prepare_step(_batch(loss_mask=torch.ones(5)), cfg, ps)
    with pytest.raises(BadBatchError, match="tokens has 11 entries but total_lengths sum to 12"):
        prepare_step(_batch(tokens=torch.arange(11)), cfg, ps)
    with pytest.raises(BadBatchError, match="sample 2: total_length=3 leaves no prompt token"):
        prepare_step(_batch(response_lengths=torch.tensor([2, 1, 3])), cfg, ps)
    old = torch.zeros(6)
    old[0] = float("inf")
    with pytest.raises(BadBatchError, match=r"sample 0: old_log_probs\[0\] = inf"):
        prepare_step(_batch(old_log_probs=old), cfg, ps)
    with pytest.raises(BadBatchError, match="sample 2: group_id 5 >= num_groups 2"):
        prepare_step(_batch(group_ids=torch.tensor([0, 1, 5])), cfg, ps, num_groups=2)
    empty = StepBatch(
        tokens=torch.zeros(0, dtype=torch.long),
        total_lengths=torch.zeros(0, dtype=torch.long),
        response_lengths=torch.zeros(0, dtype=torch.long),
        loss_mask=torch.zeros(0),
        advantages=torch.zeros(0),
        group_ids=torch.zeros(0, dtype=torch.long),
    )
    with pytest.raises(BadBatchError, match="empty step"):
        prepare_step(empty, cfg, ps)


def test_bad_data_leaves_inputs_untouched():
    """Validation fails before anything is written: the caller's tensors are unchanged."""
    adv = torch.zeros(6)
    adv[4] = float("nan")
    batch = _batch(advantages=adv)
    snapshot = {k: v.clone() for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}
    with pytest.raises(BadBatchError):
        prepare_step(batch, LossConfig(), ParallelState.single())
    for k, v in snapshot.items():
        assert torch.equal(getattr(batch, k), v) or (
            k == "advantages" and torch.equal(v.isnan(), getattr(batch, k).isnan())
        )
