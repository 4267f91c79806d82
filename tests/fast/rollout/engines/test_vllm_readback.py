"""vLLM's read-back names (``vllm_readback.checkpoint_names``): a vision-language model's module
prefixes map back to the trainer's names through the model's own ``hf_to_vllm_mapper``; a model
without prefix mapping keeps its names. The whole read-back runs for real in ``test_engines`` and
``test_vllm_images`` (every tensor bitwise, vision tower included)."""

from __future__ import annotations

import types

import pytest
import torch

from rl_plugin.rollout.engines.vllm_readback import checkpoint_names

pytest.importorskip("vllm")


def test_qwen2_5_vl_prefixes_map_back_to_the_trainers_names():
    from vllm.model_executor.models.utils import WeightsMapper

    # Qwen2_5_VLForConditionalGeneration's mapper in vllm 0.32 (its module needs torchvision to import)
    prefixes = {
        "model.language_model.": "language_model.model.",
        "model.visual.": "visual.",
        "lm_head.": "language_model.lm_head.",
        "model.": "language_model.model.",
    }
    VL = types.SimpleNamespace(hf_to_vllm_mapper=WeightsMapper(orig_to_new_prefix=prefixes))
    t = torch.zeros(1)
    got = checkpoint_names(
        VL,
        {
            "language_model.model.layers.0.mlp.down_proj.weight": t,
            "language_model.lm_head.weight": t,
            "visual.blocks.0.attn.qkv.weight": t,
        },
    )
    assert sorted(got) == [
        "lm_head.weight",
        "model.language_model.layers.0.mlp.down_proj.weight",
        "model.visual.blocks.0.attn.qkv.weight",
    ]


def test_a_model_without_prefix_mapping_keeps_its_names():
    t = torch.zeros(1)
    assert list(checkpoint_names(types.SimpleNamespace(), {"model.norm.weight": t})) == ["model.norm.weight"]
