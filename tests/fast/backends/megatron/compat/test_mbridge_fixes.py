"""Probes of ``compat.mbridge_fixes`` (mbridge 0.15.1): each fix is still needed (the plain mbridge
call fails or gives another model) and works. If a probe fails at "fails here", mbridge /
transformers fixed it upstream: delete the fix (and its line in ``compat/__init__.py``) and the probe.
Fix 5's effect on the logits is pinned by ``tests/fast/moe/test_megatron_moe.py``.
"""

from __future__ import annotations

import types

import pytest
import torch


@pytest.fixture(scope="module")
def tiny_dirs(tiny_checkpoint, tiny_qwen2):
    return {"qwen2": tiny_qwen2, "llama": tiny_checkpoint("llama", seed=1)}


# -- fix 1: rope_theta -----------------------------------------------------------------
def test_rope_theta_workaround_still_needed_and_works(tiny_dirs):
    from mbridge.core.llm_bridge import LLMBridge
    from transformers import AutoConfig

    from rl_plugin.backends.megatron.compat.mbridge_fixes import fix_rope_theta

    cfg = AutoConfig.from_pretrained(tiny_dirs["qwen2"])
    fake_bridge = types.SimpleNamespace(hf_config=cfg)
    with pytest.raises(AttributeError, match="rope_theta"):  # fails here => no longer needed
        LLMBridge._get_gptmodel_args(fake_bridge)
    assert fix_rope_theta(cfg) is True
    assert LLMBridge._get_gptmodel_args(fake_bridge)["rotary_base"] == 10000.0
    assert fix_rope_theta(cfg) is False  # idempotent


# -- fix 2: local layer spec names ---------------------------------------------------------
LOCAL_NAMES = {
    "decoder.layers.1.input_layernorm.weight": ["model.layers.1.input_layernorm.weight"],
    "decoder.layers.1.pre_mlp_layernorm.weight": ["model.layers.1.post_attention_layernorm.weight"],
}


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_local_spec_names_workaround_still_needed_and_works(family):
    import mbridge  # noqa: F401
    from mbridge.core.bridge import _MODEL_REGISTRY

    from rl_plugin.backends.megatron.compat.mbridge_fixes import local_spec_bridge_class

    plain = _MODEL_REGISTRY[family]
    fixed = local_spec_bridge_class(plain)
    for name, hf_names in LOCAL_NAMES.items():
        with pytest.raises(NotImplementedError):  # fails here => mbridge maps local names itself
            plain._weight_name_mapping_mcore_to_hf(plain.__new__(plain), name)
        assert fixed._weight_name_mapping_mcore_to_hf(fixed.__new__(fixed), name) == hf_names
    # The subclass leaves mbridge's own class maps untouched.
    assert "pre_mlp_layernorm.weight" not in plain._MLP_MAPPING


# -- fix 4: tied embeddings, one name map per bridge ----------------------------------------
def test_tied_map_workaround_still_needed_and_works(tiny_dirs, tmp_path):
    import mbridge  # noqa: F401
    from mbridge.core.bridge import _MODEL_REGISTRY
    from transformers import AutoConfig

    from rl_plugin.backends.megatron.compat.mbridge_fixes import tied_embeddings_bridge_class
    from rl_plugin.models.tiny import tiny_config

    tiny_config("qwen2", tie_word_embeddings=True).save_pretrained(tmp_path)
    tied, untied = AutoConfig.from_pretrained(tmp_path), AutoConfig.from_pretrained(tiny_dirs["qwen2"])
    plain = _MODEL_REGISTRY["qwen2"]
    saved = dict(plain._DIRECT_MAPPING)
    try:
        b = plain.__new__(plain)
        b.hf_config = tied
        b._adjust_mapping_for_shared_weights()
        # fails here => mbridge no longer writes a tied model's map into the class
        assert plain._DIRECT_MAPPING["output_layer.weight"] == "model.embed_tokens.weight"
    finally:
        plain._DIRECT_MAPPING.clear()
        plain._DIRECT_MAPPING.update(saved)
    for family in ("qwen2", "llama"):
        fixed = tied_embeddings_bridge_class(_MODEL_REGISTRY[family])
        maps = {}
        for label, cfg in (("tied", tied), ("untied", untied), ("tied again", tied)):
            b = fixed.__new__(fixed)
            b.hf_config = cfg
            b._adjust_mapping_for_shared_weights()
            maps[label] = (b._DIRECT_MAPPING["output_layer.weight"], b._get_hf_shared_weight_keys())
        assert maps["tied"] == maps["tied again"] == ("model.embed_tokens.weight", ["model.embed_tokens.weight"])
        assert maps["untied"] == ("lm_head.weight", [])
        assert _MODEL_REGISTRY[family]._DIRECT_MAPPING["output_layer.weight"] == "lm_head.weight"


# -- fix 3: sequential experts -------------------------------------------------------------------
def test_sequential_experts_fix_still_needed_and_works(monkeypatch):
    import mbridge  # noqa: F401
    from mbridge.core.bridge import _MODEL_REGISTRY

    from rl_plugin.backends.megatron.compat.mbridge_fixes import sequential_experts_bridge_class

    local = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    plain = _MODEL_REGISTRY["qwen3_moe"]
    fixed = sequential_experts_bridge_class(plain)
    b = fixed.__new__(fixed)
    b.config = types.SimpleNamespace(num_moe_experts=4)
    b.mpu = types.SimpleNamespace(ep_size=2, ep_rank=1, etp_size=1)
    with pytest.raises(NotImplementedError):  # fails here => mbridge names sequential experts itself
        plain._weight_name_mapping_mcore_to_hf(plain.__new__(plain), local)
    # the global expert 2 * 1 + 1 = 3, in mbridge's grouped-expert spelling, which mbridge then maps
    model = types.SimpleNamespace(named_parameters=lambda: iter([(local, None)]))
    monkeypatch.setattr(
        plain, "_weight_name_mapping_mcore_local_to_global", lambda self, m, consider_ep=False: {local: local}
    )
    names = fixed._weight_name_mapping_mcore_local_to_global(b, model)
    assert names[local] == "decoder.layers.0.mlp.experts.linear_fc1.weight3"
    assert fixed._weight_name_mapping_mcore_to_hf(b, names[local])[0].startswith("model.layers.0.mlp.experts.3.")
    whole = object()
    assert b._weight_split_across_tp(local, whole, None, 2) == [whole, whole]


# -- fix 5: the MoE family configs ---------------------------------------------------------------
FAMILY_PROBES = {"mixtral": ("moe_router_pre_softmax", True), "qwen2_moe": ("moe_shared_expert_gate", False)}


@pytest.mark.parametrize("family", sorted(FAMILY_PROBES))
def test_family_config_fix_still_needed(family, tmp_path):
    import mbridge  # noqa: F401
    from mbridge.core.bridge import _MODEL_REGISTRY
    from transformers import AutoConfig

    from rl_plugin.backends.megatron.compat.mbridge_fixes import FAMILY_FIXES, fix_rope_theta
    from rl_plugin.models.tiny import make_tiny_moe_checkpoint

    hf_config = AutoConfig.from_pretrained(make_tiny_moe_checkpoint(tmp_path, family, seed=0))
    fix_rope_theta(hf_config)
    cls = _MODEL_REGISTRY[family]
    b = cls.__new__(cls)
    b.hf_config, b.dtype, b.extra_args = hf_config, torch.float32, {}
    b.mpu = types.SimpleNamespace(tp_size=1, pp_size=1, ep_size=1, etp_size=1, vpp_size=None, cp_size=1)
    key, upstream = FAMILY_PROBES[family]
    assert getattr(b._build_config(), key) == upstream  # fails here => mbridge sets it as HF does
    b.extra_args = dict(FAMILY_FIXES[family])
    assert getattr(b._build_config(), key) == FAMILY_FIXES[family][key]
