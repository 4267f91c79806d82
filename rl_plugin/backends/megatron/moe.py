"""Mixture-of-experts models on the Megatron backend: mbridge's MoE bridges on megatron-core's
sequential experts, and the MoE ``TransformerConfig`` settings from the flags.

mbridge 0.15.1 converts Qwen3-MoE, Qwen2-MoE and Mixtral for transformer-engine's grouped experts
(``TEGroupedMLP``), whose parameters are ``decoder.layers.L.mlp.experts.linear_fc1.weight{e}``
(``e`` the expert's index on this EP rank). Without transformer-engine (and without the
``grouped_gemm`` package: a CPU) the layer spec is megatron-core's local one with
``SequentialMLP``, one ``MLP`` per local expert: ``...mlp.experts.local_experts.{e}.linear_fc1.weight``.
``sequential_experts_bridge_class(base)`` gives mbridge that layout:

- names: ``_weight_name_mapping_mcore_local_to_global`` rewrites
  ``mlp.experts.local_experts.{e}.linear_fcN.weight`` to mbridge's
  ``mlp.experts.linear_fcN.weight{E}``, ``E = ep_rank * local_experts + e`` (the global expert),
  so every later step of mbridge (HF names, gate/up concatenation) is its own.
- loading: mbridge loads a parameter whose LOCAL name lacks ``.mlp.experts.linear_fc`` through
  the TP path (split in ``tp_size`` pieces, scattered over the TP group). A sequential expert at
  expert-TP 1 is whole on every TP rank, so ``_weight_split_across_tp`` hands each TP rank the
  whole tensor.

The export with expert parallelism (``bridge.stream_hf`` / ``export_hf``) gathers each local
expert over the EP group (``expert_shards``) and names the pieces by global expert.

``moe_config_overrides(cfg, cuda=...)`` is what the flags set on the ``TransformerConfig``
(Megatron-LM's spellings): ``--moe-router-load-balancing-type``, ``--moe-aux-loss-coeff``,
``--moe-z-loss-coeff``, ``--moe-token-dispatcher-type``; plus, without transformer-engine, the
sequential experts (``moe_grouped_gemm`` False) and no ``persist_layer_norm`` (a TE / apex
kernel). mbridge's own MoE defaults (``moe_router_load_balancing_type="none"`` "for RL",
the HF checkpoint's ``router_aux_loss_coef``) are replaced by the flags' values, so the
objective is the one the command line states.
"""

from __future__ import annotations

import re
from typing import Dict, Optional

SEQUENTIAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def is_moe_config(hf_config) -> bool:
    return bool(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None))


def sequential_experts_bridge_class(base):
    """``base`` (an mbridge MoE bridge on the local spec) with sequential-expert names (module doc)."""

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


def expert_global_name(name: str, ep_rank: int, num_local: int) -> str:
    """mbridge's global expert name ``...linear_fcN.weight{E}`` of EP rank ``ep_rank``'s copy of the
    local expert named ``name`` (``...weight{e}``, ``e`` local): ``E = ep_rank * num_local + e``."""
    prefix, local = name.rsplit(".weight", 1)
    return f"{prefix}.weight{ep_rank * num_local + int(local)}"


def is_expert_param(global_name: str) -> bool:
    return ".mlp.experts.linear_fc" in global_name


def moe_config_overrides(moe, *, use_te: bool) -> dict:
    """``TransformerConfig`` settings of an MoE model from ``moe`` (``configs.MoEConfig``)."""
    out = dict(
        moe_router_load_balancing_type=moe.router_load_balancing_type,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_z_loss_coeff=moe.z_loss_coeff,
        moe_token_dispatcher_type=moe.token_dispatcher_type,
        moe_router_dtype=moe.router_dtype,
    )
    if not use_te:  # sequential experts; no TE / apex kernels
        out.update(moe_grouped_gemm=False, persist_layer_norm=False, moe_permute_fusion=False, moe_router_fusion=False)
    return out


# Corrections of mbridge 0.15.1's MoE configs, per model type (each pinned by a test of the
# logits against the HF model): MixtralBridge sets ``moe_router_pre_softmax=True`` (softmax over
# all experts, top-k weights not renormalised), but Mixtral renormalises its top-k softmax weights
# (transformers ``MixtralTopKRouter``), which is megatron-core's top-k-then-softmax
# (``moe_router_pre_softmax=False``). Qwen2MoEBridge maps ``mlp.shared_experts.gate_weight`` but
# never sets ``moe_shared_expert_gate``, so megatron-core builds the shared expert without its
# sigmoid gate and the HF ``shared_expert_gate`` weight is neither loaded nor exported.
FAMILY_FIXES = {"mixtral": dict(moe_router_pre_softmax=False), "qwen2_moe": dict(moe_shared_expert_gate=True)}


def moe_unsupported_reason(hf_config, *, tp: int, etp: Optional[int]) -> Optional[str]:
    """Why this MoE layout cannot run here, or None (expert-TP must be 1 or equal TP)."""
    if etp not in (None, 1, tp):
        return f"--expert-tensor-parallel-size {etp} with --tensor-model-parallel-size {tp}: use 1 or {tp}"
    return None
