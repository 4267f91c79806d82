"""Mixture-of-experts names between the transformers-5 model (fused 3-D experts) and the checkpoint
(one tensor per expert) (``rl_plugin.models.moe_names``): the split, the slot a checkpoint tensor
fills, Mixtral's block name, and dense names untouched."""

from __future__ import annotations

import torch

from rl_plugin.models.moe_names import checkpoint_slot, model_to_checkpoint, to_checkpoint

E, INTER, H = 3, 2, 4  # experts, intermediate size, hidden size
GATE_UP = torch.arange(E * 2 * INTER * H, dtype=torch.float32).view(E, 2 * INTER, H)
DOWN = torch.arange(E * H * INTER, dtype=torch.float32).view(E, H, INTER) + 1000


def test_fused_experts_split_into_checkpoint_tensors():
    got = dict(to_checkpoint("model.layers.1.mlp.experts.gate_up_proj", GATE_UP, "qwen3_moe"))
    assert list(got)[:2] == [
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "model.layers.1.mlp.experts.0.up_proj.weight",
    ]
    assert len(got) == 2 * E
    assert torch.equal(got["model.layers.1.mlp.experts.2.gate_proj.weight"], GATE_UP[2, :INTER])
    assert torch.equal(got["model.layers.1.mlp.experts.2.up_proj.weight"], GATE_UP[2, INTER:])
    down = dict(to_checkpoint("model.layers.1.mlp.experts.down_proj", DOWN, "qwen2_moe"))
    assert torch.equal(down["model.layers.1.mlp.experts.1.down_proj.weight"], DOWN[1])
    mix = dict(to_checkpoint("model.layers.0.mlp.experts.gate_up_proj", GATE_UP, "mixtral"))
    assert (
        "model.layers.0.block_sparse_moe.experts.0.w1.weight" in mix
        and "model.layers.0.block_sparse_moe.experts.0.w3.weight" in mix
    )
    assert (
        list(to_checkpoint("model.layers.0.mlp.gate.weight", DOWN, "mixtral"))[0][0]
        == "model.layers.0.block_sparse_moe.gate.weight"
    )
    assert (
        list(to_checkpoint("model.layers.0.mlp.up_proj.weight", DOWN, "qwen2"))[0][0]
        == "model.layers.0.mlp.up_proj.weight"
    )


def test_every_checkpoint_tensor_finds_its_slot_and_writes_through():
    own = {
        "model.layers.1.mlp.experts.gate_up_proj": GATE_UP.clone(),
        "model.layers.1.mlp.experts.down_proj": DOWN.clone(),
    }
    ckpt = model_to_checkpoint(own, "qwen3_moe")
    for name, tensor in ckpt.items():
        fused, view = checkpoint_slot(name, "qwen3_moe", own)
        assert fused in own and torch.equal(view, tensor), name
    fused, view = checkpoint_slot("model.layers.1.mlp.experts.1.up_proj.weight", "qwen3_moe", own)
    view.fill_(-1.0)  # a view into the fused parameter: loading writes in place
    assert bool((own[fused][1, INTER:] == -1).all()) and bool((own[fused][1, :INTER] != -1).all())
    assert checkpoint_slot("model.layers.1.mlp.experts.9.up_proj.weight", "qwen3_moe", own) == (
        "model.layers.1.mlp.experts.gate_up_proj",
        None,
    )  # no expert 9: no place, reported by the caller
    assert checkpoint_slot(
        "model.layers.0.block_sparse_moe.gate.weight", "mixtral", {"model.layers.0.mlp.gate.weight": DOWN}
    )[0] == ("model.layers.0.mlp.gate.weight")
    dense = {"lm_head.weight": DOWN}
    assert checkpoint_slot("lm_head.weight", None, dense) == ("lm_head.weight", DOWN)
    assert model_to_checkpoint(dense, None) == dense
