"""The Megatron backend's MoE helpers (``rl_plugin.backends.megatron.moe``): global expert names,
the ``TransformerConfig`` settings the flags give, the tracker names a config records, and the
router-loss metrics read from megatron-core's own tracker (one process: CP and DP of 1)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

from rl_plugin.backends.megatron.moe import (
    aux_loss_metrics,
    expert_global_name,
    is_expert_param,
    is_moe_config,
    moe_config_overrides,
    tracked_losses,
    untracked,
)
from rl_plugin.parallel import ParallelState


def _moe(dispatcher="alltoall"):
    return SimpleNamespace(
        router_load_balancing_type="aux_loss",
        aux_loss_coeff=0.01,
        z_loss_coeff=0.001,
        token_dispatcher_type=dispatcher,
        router_dtype="fp32",
    )


def test_names():
    name = "decoder.layers.1.mlp.experts.linear_fc1.weight1"
    assert expert_global_name(name, ep_rank=2, num_local=4) == "decoder.layers.1.mlp.experts.linear_fc1.weight9"
    assert is_expert_param(name) and not is_expert_param("decoder.layers.1.mlp.router.weight")
    assert is_moe_config(SimpleNamespace(num_experts=4)) and is_moe_config(SimpleNamespace(num_local_experts=8))
    assert not is_moe_config(SimpleNamespace(num_experts=0)) and not is_moe_config(SimpleNamespace())


def test_config_overrides_follow_the_flags():
    te = moe_config_overrides(_moe(), use_te=True)
    assert te == {
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 0.01,
        "moe_z_loss_coeff": 0.001,
        "moe_token_dispatcher_type": "alltoall",
        "moe_router_dtype": "fp32",
    }
    local = moe_config_overrides(_moe("allgather"), use_te=False)
    assert local["moe_shared_expert_overlap"] is False and local["variable_seq_lengths"] is False
    assert (local["moe_grouped_gemm"], local["persist_layer_norm"], local["moe_permute_fusion"]) == (
        False,
        False,
        False,
    )


@pytest.mark.parametrize(
    "kind, coeff, z, names",
    [
        ("aux_loss", 0.01, 0.001, ["load_balancing_loss", "z_loss"]),
        (["seq_aux_loss", "global_aux_loss"], 0.1, None, ["seq_load_balancing_loss", "global_load_balancing_loss"]),
        ("aux_loss", 0.0, None, []),  # a zero coefficient adds no loss
        ("none", 0.01, 0.0, ["z_loss"]),
    ],
)
def test_tracked_losses(kind, coeff, z, names):
    config = SimpleNamespace(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=coeff, moe_z_loss_coeff=z)
    assert tracked_losses(config) == names


@pytest.fixture
def tracker():
    """megatron-core's process-wide tracker, left as it was found."""
    tracker = get_moe_layer_wise_logging_tracker()
    saved = dict(tracker)
    tracker.clear()
    yield tracker
    tracker.clear()
    tracker.update(saved)


def test_aux_loss_metrics_average_over_layers_and_micro_batches_and_clear(tracker):
    config = SimpleNamespace(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    tracker["load_balancing_loss"] = {"values": torch.tensor([1.0, 2.0, 3.0])}  # per layer, summed over 2 micro-batches
    tracker["z_loss"] = {"values": torch.tensor([0.5, 0.5, 0.5])}
    with untracked():  # an idle pass: whatever it adds is forgotten
        tracker["load_balancing_loss"]["values"] += 100.0
    assert tracker["load_balancing_loss"]["values"].tolist() == [1.0, 2.0, 3.0]
    out = aux_loss_metrics(config, num_layers=3, num_micro_batches=2, ps=ParallelState.single())
    assert out == {"moe_load_balancing_loss": 1.0, "moe_z_loss": 0.25}  # 6 / 3 / 2 and 1.5 / 3 / 2
    assert float(tracker["load_balancing_loss"]["values"].abs().sum()) == 0.0  # cleared for the next step
