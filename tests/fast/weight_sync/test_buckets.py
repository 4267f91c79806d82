"""Fused groups, the bucket plan and the bitwise change test of ``rl_plugin.weight_sync.buckets``."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.weight_sync.buckets import (
    PROBE_ELEMENTS,
    changed_bitwise,
    fused_group,
    iter_buckets,
    plan_buckets,
    whole_groups,
)


def test_fused_group_keys():
    assert fused_group("model.layers.3.self_attn.k_proj.bias") == "model.layers.3.self_attn.qkv_proj"
    assert fused_group("model.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn.qkv_proj"
    assert fused_group("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up_proj"
    assert fused_group("model.layers.2.mlp.experts.7.down_proj.weight") == "model.layers.2.mlp.experts"
    assert fused_group("model.layers.3.self_attn.o_proj.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert fused_group("lm_head.weight") == "lm_head.weight"
    # a bias with its layer's weight (vLLM reloads a layer from one call's tensors: issue 46)
    assert fused_group("model.visual.blocks.0.attn.qkv.bias") == "model.visual.blocks.0.attn.qkv.weight"
    names = ["v.proj.weight", "v.norm.weight", "v.proj.bias"]
    assert whole_groups(["v.proj.weight"], names) == ["v.proj.weight", "v.proj.bias"]
    assert plan_buckets({n: 4 for n in names}, 4) == [["v.proj.weight", "v.proj.bias"], ["v.norm.weight"]]


def test_whole_groups_widen_to_the_group_in_export_order():
    qkv = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    names = ["embed", *qkv, "l.o_proj.weight", "l.up_proj.weight"]
    assert whole_groups([qkv[2]], names) == qkv
    assert whole_groups(["embed", "l.o_proj.weight"], names) == ["embed", "l.o_proj.weight"]


def test_buckets_respect_the_budget_and_keep_a_group_whole():
    q, k, v = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    sizes = {"a": 40, q: 30, k: 30, v: 30, "b": 50, "c": 200, "d": 10}
    # a (40) alone since a + qkv (90) > 100; qkv (90) whole; b (50); c (200 > budget) alone; d
    assert plan_buckets(sizes, 100) == [["a"], [q, k, v], ["b"], ["c"], ["d"]]
    assert plan_buckets(sizes, 10**6) == [list(sizes)]
    assert plan_buckets({"x": 4, "y": 4}, 8) == [["x", "y"]]  # exactly the budget fits
    with pytest.raises(ValueError, match=r"--update-weight-buffer-size must be >= 1 byte \(got 0\)"):
        plan_buckets(sizes, 0)


def test_iter_buckets_yields_contiguous_cpu_copies_in_order():
    sd = {"a": torch.arange(6.0).view(2, 3).t(), "b": torch.ones(4, dtype=torch.bfloat16)}
    buckets = list(iter_buckets(sd, 24))  # a: 24 bytes, b: 8 bytes -> two buckets
    assert [list(b) for b in buckets] == [["a"], ["b"]]
    assert buckets[0]["a"].is_contiguous() and torch.equal(buckets[0]["a"], sd["a"])


def test_changed_bitwise_sees_signed_zero_nan_payloads_and_a_change_off_the_probe():
    x = torch.zeros(3)
    assert not changed_bitwise(x, torch.zeros(3))
    assert changed_bitwise(x, torch.tensor([0.0, -0.0, 0.0]))  # -0.0 == 0.0 numerically, not bitwise
    nan_a = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)  # the default quiet NaN
    nan_b = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert changed_bitwise(nan_a, nan_b) and not changed_bitwise(nan_b, nan_b.clone())
    big = torch.zeros(4 * PROBE_ELEMENTS + 3, dtype=torch.bfloat16)
    other = big.clone()
    other[1] = 1.0  # the probe strides by 4: index 1 is not probed, the full comparison sees it
    assert changed_bitwise(big, other) and not changed_bitwise(big, big.clone())
