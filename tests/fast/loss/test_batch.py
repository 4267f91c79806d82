"""``StepBatch`` (``rl_plugin.loss.batch``): ``validate`` names the first bad sample and field,
``select`` gathers every per-token field by sample, and the batch pickles bitwise."""

from __future__ import annotations

import pickle

import pytest
import torch

from rl_plugin.loss.batch import StepBatch
from rl_plugin.loss.errors import BadBatchError


def _batch(**over):
    # samples: (prompt 2, response 3), (prompt 1, response 1), (prompt 3, response 2)
    total, resp = torch.tensor([5, 2, 5]), torch.tensor([3, 1, 2])
    fields = dict(
        tokens=torch.arange(12),
        total_lengths=total,
        response_lengths=resp,
        loss_mask=torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.5]),
        advantages=torch.tensor([0.1, 0.1, 0.1, -1.0, 2.0, 2.0]),
        group_ids=torch.tensor([0, 0, 1]),
        old_log_probs=-torch.arange(6, dtype=torch.float64),
        routed_experts=torch.arange(12 * 2 * 2, dtype=torch.int16).view(12, 2, 2),
    )
    fields.update(over)
    return StepBatch(**fields)


def test_a_valid_batch_and_its_response_sample_ids():
    b = _batch()
    assert b.validate() is b and b.num_samples == 3
    assert b.response_sample_ids().tolist() == [0, 0, 0, 1, 2, 2]


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(group_ids=torch.tensor([0, 0])), "group_ids has 2 entries for 3 samples (total_lengths)"),
        (dict(response_lengths=torch.tensor([3, -1, 4])), "sample 1: negative response_length -1"),
        (
            dict(response_lengths=torch.tensor([3, 2, 1]), loss_mask=torch.ones(6)),
            "sample 1: total_length=2 leaves no prompt token for response_length=2",
        ),
        (dict(tokens=torch.arange(11)), "tokens has 11 entries but total_lengths sum to 12"),
        (
            dict(advantages=torch.zeros(5)),
            "advantages has 5 entries but response_lengths sum to 6: the tensor ends inside sample 2",
        ),
        (
            dict(advantages=torch.zeros(7)),
            "advantages has 7 entries but response_lengths sum to 6: the tensor runs past the last sample (2)",
        ),
        (
            dict(old_log_probs=torch.tensor([0.0, 0, 0, 0, float("nan"), 0], dtype=torch.float64)),
            "sample 2: old_log_probs[0] = nan is not a finite valid value",
        ),
        (
            dict(loss_mask=torch.tensor([1.0, 1, -1, 1, 1, 1])),
            "sample 0: loss_mask[2] = -1.0 is not a finite valid value",
        ),
        (dict(group_ids=torch.tensor([0, -2, 1])), "sample 1: group_id -2 < 0"),
        (dict(routed_experts=torch.zeros(11, 2, 2)), "routed_experts has 11 entries but tokens has 12"),
    ],
    ids=["group_ids", "negative", "no_prompt", "tokens", "short", "long", "nan", "negative_mask", "group_id", "routed"],
)
def test_validate_names_the_first_bad_sample(over, message):
    with pytest.raises(BadBatchError) as err:
        _batch(**over).validate()
    assert str(err.value) == message


def test_select_gathers_each_field_by_its_own_index():
    b = _batch()
    sub = b.select(torch.tensor([2, 0]))
    assert sub.tokens.tolist() == [7, 8, 9, 10, 11, 0, 1, 2, 3, 4]
    assert sub.total_lengths.tolist() == [5, 5] and sub.response_lengths.tolist() == [2, 3]
    assert sub.loss_mask.tolist() == [1.0, 0.5, 1.0, 1.0, 0.0]
    assert sub.old_log_probs.tolist() == [-4.0, -5.0, -0.0, -1.0, -2.0]
    assert sub.group_ids.tolist() == [1, 0] and sub.ref_log_probs is None
    assert torch.equal(sub.routed_experts, b.routed_experts[[7, 8, 9, 10, 11, 0, 1, 2, 3, 4]])
    assert sub.validate() is sub and b.select(torch.zeros(0, dtype=torch.long)).num_samples == 0


def test_pickle_round_trip_is_bitwise_and_keeps_dtypes():
    b = _batch(ref_log_probs=torch.randn(6, dtype=torch.float64))
    back = pickle.loads(pickle.dumps(b))
    for name in StepBatch.TENSOR_FIELDS:
        a, c = getattr(b, name), getattr(back, name)
        assert (a is None and c is None) or (a.dtype == c.dtype and torch.equal(a, c)), name
