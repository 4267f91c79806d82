"""The shared LoRA pieces both backends build on: target resolution, canonical names, initial A."""

import math

import pytest
import torch

from rl_plugin.lora.init import initial_lora_a, initial_lora_b
from rl_plugin.lora.names import canonical_name, hf_module_path, lora_a_name, peft_file_name
from rl_plugin.lora.targets import ALL_LINEAR, UnknownTargetError, megatron_targets, resolve_targets


def test_all_linear_is_attention_and_mlp():
    assert (
        resolve_targets(["all-linear"])
        == ALL_LINEAR
        == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    )


def test_megatron_names_expand_to_their_fused_projections_and_commas_split():
    assert resolve_targets(["linear_qkv,linear_fc2"]) == ("q_proj", "k_proj", "v_proj", "down_proj")
    assert resolve_targets(["q_proj", "v_proj"]) == ("q_proj", "v_proj")
    assert resolve_targets(["all-linear"], ["linear_fc1", "o_proj"]) == ("q_proj", "k_proj", "v_proj", "down_proj")
    assert megatron_targets(("q_proj", "v_proj", "up_proj")) == {
        "linear_qkv": ("q_proj", "v_proj"),
        "linear_fc1": ("up_proj",),
    }


def test_unknown_or_empty_selection_names_the_flag():
    with pytest.raises(UnknownTargetError, match="--target-modules lm_head"):
        resolve_targets(["lm_head"])
    with pytest.raises(UnknownTargetError, match="--exclude-modules"):
        resolve_targets(["q_proj"], ["q_proj"])


def test_names_round_trip_through_a_peft_file():
    name = lora_a_name(hf_module_path(3, "up_proj"))
    assert name == "model.layers.3.mlp.up_proj.lora_A.weight"
    assert peft_file_name(name) == "base_model.model.model.layers.3.mlp.up_proj.lora_A.weight"
    assert canonical_name("base_model.model.model.layers.3.mlp.up_proj.lora_A.default.weight") == name


def test_initial_a_depends_only_on_seed_name_and_shape():
    a = initial_lora_a("x.lora_A.weight", 4, 64, seed=7)
    assert torch.equal(a, initial_lora_a("x.lora_A.weight", 4, 64, seed=7))
    assert not torch.equal(a, initial_lora_a("y.lora_A.weight", 4, 64, seed=7))
    assert not torch.equal(a, initial_lora_a("x.lora_A.weight", 4, 64, seed=8))
    bound = 1 / math.sqrt(64)  # PEFT's kaiming_uniform_(a=sqrt(5)) bound
    assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound
    assert torch.count_nonzero(initial_lora_b(4, 32)) == 0 and initial_lora_b(4, 32).shape == (32, 4)
