"""``--check-weight-sync``'s fingerprints (``rl_plugin.weight_sync.fingerprint``): sha256 of the fp32
bytes, and the error naming the first tensor that differs."""

from __future__ import annotations

import hashlib

import pytest
import torch

from rl_plugin.errors import WeightSyncError
from rl_plugin.weight_sync.fingerprint import compare_fingerprints, tensor_fingerprint, weights_fingerprint


def test_tensor_fingerprint_is_sha256_of_the_fp32_bytes():
    t = torch.tensor([[1.0, -2.5], [3.0, 0.125]])
    assert tensor_fingerprint(t) == hashlib.sha256(t.numpy().tobytes()).hexdigest()
    assert tensor_fingerprint(t.t()) == hashlib.sha256(t.t().contiguous().numpy().tobytes()).hexdigest()
    bf = t.to(torch.bfloat16)  # these values are exact in bf16: the fp32 bytes are the same
    assert tensor_fingerprint(bf) == tensor_fingerprint(t)


def test_weights_fingerprint_is_sorted_by_name_and_sees_one_bit():
    a = torch.ones(4)
    b = a.clone()
    b.view(torch.int32)[2] ^= 1  # the lowest mantissa bit
    fp = weights_fingerprint({"z": a, "a": a})
    assert list(fp) == ["a", "z"]
    assert weights_fingerprint({"x": a})["x"] != weights_fingerprint({"x": b})["x"]


def test_compare_names_the_first_differing_or_missing_tensor():
    trainer = {"a": "1" * 64, "b": "2" * 64, "c": "3" * 64}
    compare_fingerprints(trainer, dict(trainer))  # equal: returns
    assert compare_fingerprints(trainer, {**trainer, "extra": "x"}) is None  # engine-only tensors are not checked
    with pytest.raises(
        WeightSyncError, match=r"differ from the trainer's at 'b' \(sha256 ffffffffffff vs 222222222222\)"
    ):
        compare_fingerprints(trainer, {**trainer, "b": "f" * 64, "c": "e" * 64})
    with pytest.raises(WeightSyncError, match=r"has no tensor 'a' that the trainer exports"):
        compare_fingerprints(trainer, {"b": "2" * 64, "c": "3" * 64})


def test_weight_sync_check_names_the_tensor():
    sd = {"a.weight": torch.ones(3), "b.weight": torch.zeros(2)}
    fp = weights_fingerprint(sd)
    compare_fingerprints(fp, dict(fp))  # equal: no error
    bad = weights_fingerprint({"a.weight": torch.ones(3), "b.weight": torch.tensor([0.0, 1e-30])})
    with pytest.raises(WeightSyncError, match=r"rollout weights differ from the trainer's at 'b.weight'"):
        compare_fingerprints(fp, bad)
    with pytest.raises(WeightSyncError, match=r"has no tensor 'c'"):
        compare_fingerprints({**fp, "c": "x"}, fp)
