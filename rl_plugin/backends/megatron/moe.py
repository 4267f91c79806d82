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

import contextlib
import re
from typing import Dict, List, Optional

import torch

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


# -- aux-loss metrics ---------------------------------------------------------------------------
# megatron-core's tracker names of the losses a config adds (router.py): load-balancing type ->
# name, and the z-loss
TRACKER_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


def tracked_losses(config) -> List[str]:
    """The tracker names this ``TransformerConfig`` records in a training forward (fixed per run,
    so every rank reduces the same list)."""
    names = []
    kind = config.moe_router_load_balancing_type
    kinds = kind if isinstance(kind, list) else [kind]
    for k in kinds:
        if k in TRACKER_NAMES and (config.moe_aux_loss_coeff or 0) > 0:
            names.append(TRACKER_NAMES[k])
    if config.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


def num_moe_layers(model) -> int:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return sum(isinstance(m, MoELayer) for m in model.modules())


@contextlib.contextmanager
def untracked():
    """Leave megatron-core's aux-loss tracker as it was (an idle pass's token is no sample)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    saved = {k: v["values"].clone() for k, v in tracker.items() if "values" in v}
    try:
        yield
    finally:
        for k, v in tracker.items():
            if "values" in v:
                v["values"] = saved[k] if k in saved else torch.zeros_like(v["values"])


def clear_tracker() -> None:
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def aux_loss_metrics(config, num_layers: int, num_micro_batches: int, ps) -> Dict[str, float]:
    """``moe_<name>``: each tracked loss (without its coefficient), averaged over MoE layers and
    this rank's micro-batches, summed over CP and averaged over DP (Megatron-LM's
    ``track_moe_metrics`` reduction); clears the tracker. Collective over DP x CP."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from rl_plugin.parallel import all_reduce

    names = tracked_losses(config)
    if not names:
        return {}
    tracker = get_moe_layer_wise_logging_tracker()
    local = torch.zeros(len(names), dtype=torch.float64)
    for j, name in enumerate(names):
        if name in tracker and "values" in tracker[name]:
            local[j] = float(tracker[name]["values"].double().sum()) / max(num_layers, 1) / max(num_micro_batches, 1)
    all_reduce(local, ps.cp_group)
    all_reduce(local, ps.dp_group)
    local /= ps.dp_size
    clear_tracker()
    return {f"moe_{name}": float(v) for name, v in zip(names, local.tolist())}
