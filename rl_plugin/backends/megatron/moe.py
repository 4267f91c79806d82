"""Mixture-of-experts models on the Megatron backend: expert names in the export, and the MoE
``TransformerConfig`` settings from the flags.

Without transformer-engine the experts are megatron-core's sequential ones, which mbridge 0.15.1
converts only through ``compat.mbridge_fixes.sequential_experts_bridge_class`` (fix 3 there);
mbridge's MoE configs need the corrections ``compat.mbridge_fixes.FAMILY_FIXES`` (fix 5).

The export (``bridge.export_hf`` / ``stream_hf`` / ``hf_specs``) gathers each local expert over
expert-TP, then over EP (``bridge._experts_to_all`` / ``_experts_to_root``), and names the pieces by
global expert (``expert_global_name``), in EP-rank order, as mbridge's ``export_weights`` does.

The router-loss metrics: ``aux_loss_metrics``; idle
passes leave megatron-core's loss tracker as it was (``untracked``).

``moe_config_overrides(moe, use_te=...)`` is what the flags set on the ``TransformerConfig``
(Megatron-LM's spellings): ``--moe-router-load-balancing-type``, ``--moe-aux-loss-coeff``,
``--moe-z-loss-coeff``, ``--moe-token-dispatcher-type`` (allgather: no ``moe_shared_expert_overlap``
and no ``variable_seq_lengths``, which megatron-core allows only with alltoall); plus, without
transformer-engine, the
sequential experts (``moe_grouped_gemm`` False) and no ``persist_layer_norm`` (a TE / apex
kernel). mbridge's own MoE defaults (``moe_router_load_balancing_type="none"`` "for RL",
the HF checkpoint's ``router_aux_loss_coef``) are replaced by the flags' values, so the
objective is the one the command line states.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List

import torch


def is_moe_config(hf_config) -> bool:
    return bool(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None))


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
    if moe.token_dispatcher_type != "alltoall":
        # mbridge's Qwen2-MoE sets moe_shared_expert_overlap (a side stream on GPUs), which megatron-core
        # accepts only with the alltoall dispatcher (TransformerConfig raises otherwise): the overlap is
        # a speed-up only, so it is off with the other dispatchers. megatron-core also refuses allgather
        # with variable_seq_lengths, which only the pipeline's P2P reads (an MoE model never runs in a
        # pipeline here, model_layout) and which allgather cannot honour across EP ranks (EP 1 only:
        # configs.model.MoEConfig.check)
        out.update(moe_shared_expert_overlap=False, variable_seq_lengths=False)
    if not use_te:  # sequential experts; no TE / apex kernels
        out.update(moe_grouped_gemm=False, persist_layer_norm=False, moe_permute_fusion=False, moe_router_fusion=False)
    return out


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


def aux_loss_metrics(config, num_layers: int, num_micro_batches: int, ps, device=None) -> Dict[str, float]:
    """``moe_<name>``: each tracked loss (without its coefficient), averaged over MoE layers and
    this rank's micro-batches, summed over CP and averaged over DP (Megatron-LM's
    ``track_moe_metrics`` reduction); clears the tracker. Collective over DP x CP.

    Devices (``parallel``'s contract): ``cp_group`` is megatron's own group, NCCL on GPUs, so the
    CP sum runs on ``device`` (the loss device, the model's; float64, which NCCL reduces too); the
    DP mean on the CPU (``dp_group`` is a gloo twin). A CPU tensor on an NCCL group fails (issue 37
    item 5)."""
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
    if ps.cp_group is not None:
        local = all_reduce(local.to(device or "cpu"), ps.cp_group).cpu()
    all_reduce(local, ps.dp_group)
    local /= ps.dp_size
    clear_tracker()
    return {f"moe_{name}": float(v) for name, v in zip(names, local.tolist())}
