"""Probes of ``compat.mbridge_vl`` (mbridge 0.15.1's Qwen2.5-VL on megatron-core 0.16.1 without
transformer-engine): each assertion marked "fails here" fails when upstream fixes what the
workaround repairs; then delete that fix. The workaround working is proven by
``tests/fast/backends/megatron/test_vision.py`` (log-probs = HF at TP1/TP2/DP2)."""

from __future__ import annotations

import inspect
from copy import deepcopy
from types import SimpleNamespace


def test_fix1_mbridge_builds_the_vl_model_on_transformer_engine_only():
    from mbridge.models.qwen2_5_vl import Qwen2_5VLBridge

    source = inspect.getsource(Qwen2_5VLBridge._model_provider)
    assert "get_vit_layer_with_transformer_engine_spec" in source  # fails here when mbridge offers a local spec
    assert "TEColumnParallelLinear" in source


def test_fix2_mbridge_hard_codes_the_7b_vision_tower():
    from mbridge.models.qwen2_5_vl.transformer_config import get_vision_model_config
    from megatron.core.transformer import TransformerConfig

    from rl_plugin.backends.megatron.compat.mbridge_vl import vision_config

    lang = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=2, use_cpu_initialization=True)
    upstream = get_vision_model_config(deepcopy(lang))
    assert (upstream.num_layers, upstream.hidden_size) == (32, 1280)  # fails here when mbridge reads the HF config
    vc = SimpleNamespace(
        depth=2,
        hidden_size=64,
        num_heads=2,
        intermediate_size=128,
        hidden_act="silu",
        temporal_patch_size=2,
        patch_size=14,
        in_channels=3,
        spatial_merge_size=2,
        fullatt_block_indexes=[1],
        window_size=56,
    )
    ours = vision_config(lang, vc)
    assert (ours.num_layers, ours.hidden_size, ours.num_attention_heads, ours.ffn_hidden_size) == (2, 64, 2, 128)
    assert ours.fullatt_block_indexes == [1] and ours._qwen2_5_vl_window_size == 56


def test_fix3_transformers5_keeps_the_text_sizes_in_text_config(tmp_path):
    from transformers import AutoConfig

    from rl_plugin.backends.megatron.compat.mbridge_vl import text_sizes_on_top
    from rl_plugin.models.tiny_vl import tiny_vl_config

    tiny_vl_config().save_pretrained(tmp_path)
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert getattr(cfg, "num_key_value_heads", None) is None  # fails here when the top-level config has it
    assert getattr(cfg, "rope_scaling", None) is None
    text_sizes_on_top(cfg)
    assert (cfg.num_key_value_heads, cfg.hidden_size, cfg.num_attention_heads) == (1, 64, 2)


def test_fix4_mbridge_maps_only_the_fused_norm_names():
    from mbridge.models.qwen2_5_vl import Qwen2_5VLBridge

    from rl_plugin.backends.megatron.compat.mbridge_vl import vl_bridge_class
    from rl_plugin.backends.megatron.vision import VLModel

    key = "language_model.decoder.layers.{layer_number}.pre_mlp_layernorm.weight"
    assert key not in Qwen2_5VLBridge._MLP_MAPPING  # fails here when mbridge maps the local spec's norms
    ours = vl_bridge_class(Qwen2_5VLBridge, VLModel)
    assert ours._MLP_MAPPING[key] == ["model.layers.{layer_number}.post_attention_layernorm.weight"]
    names = ours._weight_name_mapping_other(None, "vision_model.decoder.layers.3.input_layernorm.weight")
    assert names == ["visual.blocks.3.norm1.weight"]


def test_fix6_mbridge_attention_lacks_the_rotary_cos_sin_keyword():
    from mbridge.models.qwen2_5_vl.attention import Qwen2_5VLSelfAttention

    from rl_plugin.backends.megatron.compat.mbridge_vl import _vl_self_attention

    # fails here when mbridge's attention takes megatron-core 0.16.1's keyword
    assert "rotary_pos_cos_sin" not in inspect.signature(Qwen2_5VLSelfAttention.forward).parameters
    assert "rotary_pos_cos_sin" in inspect.signature(_vl_self_attention().forward).parameters


def test_fix7_mbridge_splits_the_merger_with_the_language_config():
    from mbridge.core.bridge import Bridge

    stand_in = SimpleNamespace(config="language")
    # fails here when mbridge picks the config by name
    assert Bridge._get_mcore_config_by_name(stand_in, "vision_model.projection.encoder.linear_fc1.weight") == "language"


def test_fix8_mbridge_exports_transformers4_names():
    from mbridge.models.qwen2_5_vl import Qwen2_5VLBridge

    from rl_plugin.backends.megatron.compat.mbridge_vl import transformers5_name

    # fails here when mbridge names the weights as transformers 5's Qwen2.5-VL does
    assert Qwen2_5VLBridge._DIRECT_MAPPING["vision_model.patch_embed.proj.weight"] == "visual.patch_embed.proj.weight"
    assert transformers5_name("visual.patch_embed.proj.weight") == "model.visual.patch_embed.proj.weight"
    assert transformers5_name("model.layers.0.mlp.up_proj.weight") == "model.language_model.layers.0.mlp.up_proj.weight"
    assert transformers5_name("lm_head.weight") == "lm_head.weight"
