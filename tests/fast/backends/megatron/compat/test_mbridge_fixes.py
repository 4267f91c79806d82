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
# (family, norm_topk_prob of the tiny checkpoint): the setting mbridge builds, and what HF needs
FAMILY_PROBES = {
    ("mixtral", None): ("moe_router_pre_softmax", True, False),
    ("qwen2_moe", None): ("moe_shared_expert_gate", False, True),
    # issue 37 #13: the Qwen routers renormalise as norm_topk_prob says; mbridge hard-codes one form
    ("qwen2_moe", True): ("moe_router_pre_softmax", True, False),
    ("qwen3_moe", False): ("moe_router_pre_softmax", False, True),
}


def _bare_bridge(family, tmp_path, norm=None):
    import mbridge  # noqa: F401
    from mbridge.core.bridge import _MODEL_REGISTRY
    from transformers import AutoConfig

    from rl_plugin.backends.megatron.compat.mbridge_fixes import fix_rope_theta
    from rl_plugin.models.tiny import make_tiny_moe_checkpoint

    kw = {} if norm is None else {"norm_topk_prob": norm}
    hf_config = AutoConfig.from_pretrained(make_tiny_moe_checkpoint(tmp_path, family, seed=0, **kw))
    fix_rope_theta(hf_config)
    cls = _MODEL_REGISTRY[family]
    b = cls.__new__(cls)
    b.hf_config, b.dtype, b.extra_args = hf_config, torch.float32, {}
    b.mpu = types.SimpleNamespace(tp_size=1, pp_size=1, ep_size=1, etp_size=1, vpp_size=None, cp_size=1)
    return b, hf_config


@pytest.mark.parametrize("family, norm", sorted(FAMILY_PROBES, key=str))
def test_family_config_fix_still_needed(family, norm, tmp_path):
    from rl_plugin.backends.megatron.compat.mbridge_fixes import family_fixes

    b, hf_config = _bare_bridge(family, tmp_path, norm)
    key, upstream, needed = FAMILY_PROBES[family, norm]
    assert getattr(b._build_config(), key) == upstream  # fails here => mbridge sets it as HF does
    b.extra_args = family_fixes(family, hf_config)
    assert getattr(b._build_config(), key) == needed


def test_qwen2_moe_shared_expert_overlap_is_off_with_the_allgather_dispatcher(tmp_path):
    """Issue 37 #13: mbridge's Qwen2-MoE sets moe_shared_expert_overlap, which megatron-core's
    TransformerConfig refuses with any dispatcher but alltoall (on GPUs: the CPU shim turns the
    overlap off anyway), as it refuses allgather with variable_seq_lengths (set by mbridge and the
    backend for the pipeline's P2P); --moe-token-dispatcher-type allgather now builds, without both."""
    import dataclasses

    from rl_plugin.backends.megatron.compat.mbridge_fixes import family_fixes
    from rl_plugin.backends.megatron.moe import moe_config_overrides
    from rl_plugin.configs import MoEConfig

    b, hf_config = _bare_bridge("qwen2_moe", tmp_path)
    allgather = dataclasses.replace(MoEConfig(), token_dispatcher_type="allgather")
    b.extra_args = {**family_fixes("qwen2_moe", hf_config), **moe_config_overrides(allgather, use_te=True)}
    config = b._build_config()  # before the fix: ValueError, overlap only works with alltoall
    assert config.moe_token_dispatcher_type == "allgather" and config.moe_shared_expert_overlap is False
    assert config.variable_seq_lengths is False  # megatron-core refuses allgather with variable lengths
    b.extra_args = {**family_fixes("qwen2_moe", hf_config), **moe_config_overrides(MoEConfig(), use_te=True)}
    assert b._build_config().moe_shared_expert_overlap is True  # alltoall: mbridge's overlap stays
