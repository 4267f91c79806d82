"""mbridge 0.15.1 fixes: the bridge subclasses and config corrections rl_plugin's bridge needs.

``rl_plugin.backends.megatron.bridge.make_bridge`` applies them; each is pinned by a probe test
that fails when the fix stops being needed or stops working (``tests/fast/backends/megatron/compat/
test_mbridge_fixes.py``; fix 5 by ``tests/fast/moe/test_megatron_moe.py``, which also runs each
family without its correction). mbridge 0.15.1 is the newest mbridge release.

1. ``fix_rope_theta`` (mbridge 0.15.1 with transformers >= 5): transformers 5 keeps ``rope_theta``
   inside ``config.rope_parameters``; mbridge's ``LLMBridge._get_gptmodel_args`` reads
   ``hf_config.rope_theta`` (AttributeError). The value is copied onto the config first.
2. ``local_spec_bridge_class`` (mbridge 0.15.1, without transformer-engine): mbridge builds with
   ``get_gpt_decoder_block_spec(use_transformer_engine=True)`` and maps only TE's fused
   layer-norm names (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``). The
   local (megatron-core only) spec has separate ``input_layernorm`` / ``pre_mlp_layernorm``
   modules: the subclass builds that spec, adds those two names to mbridge's maps, and swaps the
   core attention for ``compat.local_attention.VarlenDotProductAttention`` (packed ``thd``
   micro-batches without TE).
3. ``sequential_experts_bridge_class`` (mbridge 0.15.1, MoE without transformer-engine):
   mbridge's MoE bridges (Qwen3-MoE, Qwen2-MoE, Mixtral) name experts as TE's ``TEGroupedMLP``
   (``decoder.layers.L.mlp.experts.linear_fc1.weight{e}``); megatron-core's local spec has
   ``SequentialMLP`` (``...mlp.experts.local_experts.{e}.linear_fc1.weight``). The subclass
   rewrites the local names to mbridge's global ones (``E = ep_rank * local_experts + e``), so
   every later step of mbridge (HF names, gate/up concatenation) is its own, and hands each TP
   rank the whole expert at expert-TP 1 (mbridge's TP path would split it in ``tp_size`` pieces).
4. ``tied_embeddings_bridge_class`` (mbridge 0.15.1): Qwen2Bridge (and Qwen3Bridge, its
   subclass) maps a tied output layer by writing into the CLASS's ``_DIRECT_MAPPING``, so every
   later untied Qwen2/Qwen3 bridge in the process maps ``output_layer.weight`` to the embedding and
   fails to load; LLaMABridge does not map a tied output layer at all (a last pipeline stage's
   ``output_layer.weight`` would look for an absent ``lm_head.weight``). Every bridge keeps its own
   copy of the map, with the output layer on ``model.embed_tokens.weight`` exactly when
   ``tie_word_embeddings``.
5. ``FAMILY_FIXES`` (mbridge 0.15.1 MoE configs, per model type): see the comment at the table.

No upstream issue was found for any of them (searched mbridge and Megatron-LM issues).
"""

from __future__ import annotations

import re
from typing import Dict, Optional

SEQUENTIAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def fix_rope_theta(hf_config) -> bool:
    """Fix 1. Returns True if the config needed it (rope_theta only in rope_parameters)."""
    if hasattr(hf_config, "rope_theta"):
        return False
    params = getattr(hf_config, "rope_parameters", None) or {}
    if "rope_theta" not in params:
        raise ValueError(f"{type(hf_config).__name__} has neither rope_theta nor rope_parameters['rope_theta']")
    hf_config.rope_theta = float(params["rope_theta"])
    return True


def tied_embeddings_bridge_class(base):
    """Fix 4: ``base`` with an instance copy of its name map (module docstring)."""
    untied_output = base._DIRECT_MAPPING.get("output_layer.weight", "lm_head.weight")

    class OwnMapBridge(base):
        def _adjust_mapping_for_shared_weights(self):
            self._DIRECT_MAPPING = dict(base._DIRECT_MAPPING)
            tied = getattr(self.hf_config, "tie_word_embeddings", False)
            embed = self._DIRECT_MAPPING["embedding.word_embeddings.weight"]
            self._DIRECT_MAPPING["output_layer.weight"] = embed if tied else untied_output

        def _get_hf_shared_weight_keys(self):
            if getattr(self.hf_config, "tie_word_embeddings", False):
                return [self._DIRECT_MAPPING["embedding.word_embeddings.weight"]]
            return []

    OwnMapBridge.__name__ = f"OwnMap{base.__name__}"
    return OwnMapBridge


def local_spec_bridge_class(base):
    """Fix 2: ``base`` (an mbridge LLMBridge subclass) on the local layer spec."""

    class LocalSpecBridge(base):
        _MLP_MAPPING = {
            **base._MLP_MAPPING,
            "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
        }
        _OTHER_MAPPING = {
            **base._OTHER_MAPPING,
            "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"],
        }

        def _get_transformer_layer_spec(self, vp_stage: Optional[int] = None):
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

            from rl_plugin.backends.megatron.compat.local_attention import VarlenDotProductAttention

            self.has_vp_stage = True  # megatron-core 0.16.1 GPTModel takes vp_stage (the interleaved schedule)
            spec = get_gpt_layer_local_spec(
                num_experts=self.config.num_moe_experts,  # MoE: megatron-core's SequentialMLP (moe.py)
                moe_grouped_gemm=False,
                qk_layernorm=self.config.qk_layernorm,
                normalization="RMSNorm",
            )
            spec.submodules.self_attention.submodules.core_attention = VarlenDotProductAttention
            return spec

    LocalSpecBridge.__name__ = f"LocalSpec{base.__name__}"
    return LocalSpecBridge


def sequential_experts_bridge_class(base):
    """``base`` (an mbridge MoE bridge on the local spec) with sequential-expert names and TP split (fix 3, module docstring)."""

    class SequentialExpertsBridge(base):
        def _weight_name_mapping_mcore_local_to_global(self, model, consider_ep: bool = True) -> Dict[str, str]:
            names = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
            local = self.config.num_moe_experts // self.mpu.ep_size
            offset = self.mpu.ep_rank * local if consider_ep else 0
            for k, v in names.items():
                m = SEQUENTIAL_EXPERT.search(v)
                if m:
                    names[k] = f"{v[: m.start()]}.mlp.experts.{m.group(2)}.weight{int(m.group(1)) + offset}"
            return names

        def _weight_split_across_tp(self, mcore_weights_name, mcore_weights, param, tp_split_size):
            if ".mlp.experts.local_experts." in mcore_weights_name and self.mpu.etp_size == 1:
                return [mcore_weights] * tp_split_size  # whole on every TP rank (module docstring)
            return super()._weight_split_across_tp(mcore_weights_name, mcore_weights, param, tp_split_size)

    SequentialExpertsBridge.__name__ = f"SequentialExperts{base.__name__}"
    return SequentialExpertsBridge


# Fix 5. Corrections of mbridge 0.15.1's MoE configs, per model type, from the HF config (each
# pinned by a test of the logits against the HF model, ``tests/fast/moe/test_megatron_moe.py``):
#
# - the router's top-k weights. HF computes p = softmax(logits) over all experts, takes the top k
#   and renormalises them (p_i / sum of the k) exactly when it should: always for Mixtral
#   (``MixtralTopKRouter``), when ``norm_topk_prob`` for Qwen2-MoE and Qwen3-MoE (both configs
#   default to False; the released Qwen3-MoE checkpoints set True, Qwen1.5/2-MoE False).
#   megatron-core's ``moe_router_pre_softmax=False`` (top-k of the logits, softmax over the k:
#   exp(l_i) / sum_k exp(l_j) = p_i / sum_k p_j) is the renormalised form, ``True`` (softmax over
#   all experts, then top-k) the plain one; ``moe_router_topk_scaling_factor`` stays unset (HF scales
#   nothing). mbridge hard-codes one per family (Mixtral True: wrong always; Qwen2-MoE True, Qwen3-MoE
#   False: right only for the released checkpoints), so it is set from ``norm_topk_prob`` here.
# - Qwen2MoEBridge maps ``mlp.shared_experts.gate_weight`` but never sets ``moe_shared_expert_gate``,
#   so megatron-core builds the shared expert without its sigmoid gate and the HF
#   ``shared_expert_gate`` weight is neither loaded nor exported.
# (Qwen2MoEBridge's ``moe_shared_expert_overlap=True``, which megatron-core accepts only with the
# alltoall dispatcher, is turned off with any other dispatcher by ``moe.moe_config_overrides``.)


def _router_normalisation(hf_config) -> dict:
    return dict(moe_router_pre_softmax=not bool(getattr(hf_config, "norm_topk_prob", False)))


FAMILY_FIXES = {
    "mixtral": lambda hf_config: dict(moe_router_pre_softmax=False),
    "qwen2_moe": lambda hf_config: dict(moe_shared_expert_gate=True, **_router_normalisation(hf_config)),
    "qwen3_moe": _router_normalisation,
}


def family_fixes(model_type: str, hf_config) -> dict:
    """Fix 5's ``TransformerConfig`` settings for ``model_type`` (``{}`` for another family)."""
    fix = FAMILY_FIXES.get(model_type)
    return fix(hf_config) if fix is not None else {}
