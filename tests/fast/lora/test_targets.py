"""LoRA target resolution (``rl_plugin.lora.targets``): ``--target-modules`` / ``--exclude-modules``
to Hugging Face projection names, and Megatron's fused linears to the projections inside them."""

import pytest

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
