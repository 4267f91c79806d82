"""Hugging Face <-> megatron-core through mbridge: the bridge, model building and the HF export.

``make_bridge(hf_dir, dtype=..., extra_config=...)`` returns an mbridge ``Bridge`` for the
checkpoint's family (Qwen2, Qwen3, Llama, Mistral as Llama, and whatever else mbridge registers,
see ``supported_model_types``; anything else is refused by ``rl_plugin.backends.model_families``); ``build_gpt_model(bridge)``
builds the bare megatron-core ``GPTModel``; ``bridge.load_weights([model], hf_dir)`` loads HF
tensors (scattering TP shards); ``export_hf(bridge, model)`` yields ``(hf_name, tensor)`` with TP
shards gathered, on every rank.

The mbridge 0.15.1 fixes (``rope_theta`` under transformers 5, the local layer spec, sequential
experts, the tied-embedding name map, the MoE family configs) live in
``rl_plugin.backends.megatron.compat.mbridge_fixes``; ``make_bridge`` applies them.

Export at PP = 1 (``_export_one_stage``): mbridge's ``export_weights`` runs three PP-group object
collectives per parameter (``all_gather_object`` of its name and tensor spec,
``broadcast_object_list``) to find which stage holds it, even with one stage (~7 ms per export of
the tiny model on CPU). With one stage every parameter is local, so ``export_hf`` runs mbridge's
own per-parameter conversion (``_weight_name_mapping_mcore_local_to_global``, the TP all-gather,
``_weight_merge_across_tp``, ``_weight_to_hf_format``) on ``named_parameters`` directly; the output
equals ``export_weights``' tensor by tensor (``test_bridge.py`` compares both). A
mixture-of-experts layer's local experts are gathered over expert-TP, then over EP, and named by
global expert (``moe.expert_global_name``), in EP-rank order, as ``export_weights`` does.

Mistral (no sliding window, as Mistral 7B v0.2+) has Llama's layers and weight names; mbridge
0.15.1 registers no ``mistral`` bridge, so it is converted by the Llama bridge
(``rl_plugin.backends.model_families.MODEL_TYPE_ALIASES``); a sliding window shorter than the context
is refused there (megatron's full attention would be another model).

Streaming export for the weight sync (``hf_specs`` / ``stream_hf``, one stage only): the same
conversion, but only the TP group of DP rank 0 (CP rank 0) takes part, its shards are gathered to
TP rank 0 (global rank 0) alone (``dist.gather``, not ``all_gather``), and that rank yields each
HF tensor as it is made; every other DP / CP replica returns at once. ``hf_specs`` runs the
conversion on meta tensors: the names, shapes and dtypes of the export, nothing materialised.
"""

from __future__ import annotations

import importlib.util
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _registry() -> Dict[str, type]:
    import mbridge  # noqa: F401  (registers the model families)
    from mbridge.core.bridge import _MODEL_REGISTRY

    return _MODEL_REGISTRY


def supported_model_types() -> List[str]:
    """mbridge's text (not vision-language) bridges and the aliases, read from mbridge:
    ``rl_plugin.backends.model_families`` splits them into the dense types this backend builds and the
    MoE types it refuses (a test keeps the tables equal to this)."""
    from mbridge.core.vlm_bridge import VLMBridge

    from rl_plugin.backends.model_families import MODEL_TYPE_ALIASES

    text = [t for t, cls in _registry().items() if not issubclass(cls, VLMBridge)]
    return sorted(text + [a for a, t in MODEL_TYPE_ALIASES.items() if t in text])


def make_bridge(
    hf_dir: str,
    *,
    dtype: torch.dtype = torch.float32,
    extra_config: Optional[Dict] = None,
    use_te: Optional[bool] = None,
    moe=None,
):
    """An mbridge bridge for ``hf_dir`` (config only; weights are loaded by ``load_weights``).
    A mixture-of-experts checkpoint also gets ``moe.moe_config_overrides(moe)`` (``moe``: a
    ``configs.MoEConfig``, default its defaults) and, without transformer-engine, sequential experts."""
    from transformers import AutoConfig

    from rl_plugin.backends.megatron.compat.mbridge_fixes import (
        family_fixes,
        fix_rope_theta,
        local_spec_bridge_class,
        sequential_experts_bridge_class,
        tied_embeddings_bridge_class,
    )
    from rl_plugin.backends.megatron.moe import is_moe_config, moe_config_overrides
    from rl_plugin.backends.model_families import MODEL_TYPE_ALIASES, megatron_unsupported_reason
    from rl_plugin.configs import MoEConfig

    hf_config = AutoConfig.from_pretrained(hf_dir)
    fix_rope_theta(hf_config)
    reason = megatron_unsupported_reason(hf_config.to_dict())
    if reason is not None:
        raise ValueError(f"--hf-checkpoint {hf_dir}: {reason}")
    model_type = MODEL_TYPE_ALIASES.get(hf_config.model_type, hf_config.model_type)
    cls = tied_embeddings_bridge_class(_registry()[model_type])
    if use_te is None:
        use_te = transformer_engine_available()
    if not use_te:
        cls = local_spec_bridge_class(cls)
    extra_config = dict(extra_config or {})
    if is_moe_config(hf_config):
        if not use_te:
            cls = sequential_experts_bridge_class(cls)
        extra_config.update(family_fixes(model_type, hf_config))
        extra_config.update(moe_config_overrides(moe or MoEConfig(), use_te=use_te))
    bridge = cls(hf_config, dtype=dtype)
    if extra_config:
        bridge.set_extra_args(**extra_config)
    return bridge


def build_gpt_model(bridge):
    """The bare GPTModel of this rank's pipeline stage described by the bridge: the embedding on
    the first stage (``pre_process``), the final norm and output layer on the last
    (``post_process``), this stage's share of the layers (megatron-core splits them evenly)."""
    from megatron.core import parallel_state as mpu

    return bridge._model_provider([])(
        pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage()
    )


def build_gpt_chunks(bridge) -> list:
    """This pipeline rank's model chunks (``chunks.py``): one ``build_gpt_model`` without the
    interleaved schedule; with it, chunk ``v`` is built with ``vp_stage=v`` (its layers' global
    numbers), the embedding only on the first virtual stage, the head only on the last."""
    from megatron.core import parallel_state as mpu

    vpp = mpu.get_virtual_pipeline_model_parallel_world_size()
    if not vpp or vpp == 1:
        return [build_gpt_model(bridge)]
    provider = bridge._model_provider([])
    return [
        provider(
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
            vp_stage=v,
        )
        for v in range(vpp)
    ]


def export_hf(bridge, model) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for every weight, TP shards gathered and every expert of every EP rank;
    collective over TP, expert-TP and EP. One pipeline stage: ``_export_one_stage``; else mbridge's
    ``export_weights``."""
    from mbridge.core.util import unwrap_model

    from rl_plugin.backends.megatron.chunks import chunks_of
    from rl_plugin.backends.megatron.pipeline_export import without_grad

    core = unwrap_model(chunks_of(model)[0])
    if not _one_stage(bridge, core):
        # no_grad: mbridge broadcasts each parameter itself across the pipeline (in place)
        return without_grad(bridge.export_weights(chunks_of(model)))
    return _export_one_stage(bridge, core)


def _one_stage(bridge, core) -> bool:
    """One pipeline stage, no expert bias: ``_export_one_stage`` applies (with or without expert parallelism)."""
    return not (bridge.mpu.pp_size > 1 or any("expert_bias" in k for k in core.state_dict()))


def _num_local_experts(bridge) -> int:
    return bridge.config.num_moe_experts // bridge.mpu.ep_size


def hf_specs(bridge, model) -> Optional[Dict[str, torch.Tensor]]:
    """The export's names, shapes and dtypes as meta tensors, in export order, from this rank's
    shards alone (no collective); None beyond one stage (mbridge's own export decides there)."""
    from mbridge.core.util import unwrap_model

    from rl_plugin.backends.megatron.moe import expert_global_name, is_expert_param

    core = unwrap_model(model)
    if not _one_stage(bridge, core):
        return None
    global_name = bridge._weight_name_mapping_mcore_local_to_global(core, consider_ep=False)
    out: Dict[str, torch.Tensor] = {}
    for local_name, param in core.named_parameters():
        name = global_name[local_name]
        tensor = torch.empty(param.shape, dtype=param.dtype, device="meta")
        if is_expert_param(name):
            if bridge.mpu.etp_size > 1:
                tensor = bridge._weight_merge_across_tp(name, [tensor] * bridge.mpu.etp_size, param)
            named = [
                (expert_global_name(name, r, _num_local_experts(bridge)), tensor) for r in range(bridge.mpu.ep_size)
            ]
        else:
            if getattr(param, "tensor_model_parallel", False):
                tensor = bridge._weight_merge_across_tp(name, [tensor] * bridge.mpu.tp_size, param)
            named = [(name, tensor)]
        for name, tensor in named:
            for hf_name, t in zip(*bridge._weight_to_hf_format(name, tensor)):
                out[hf_name] = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return out


def _experts_to_all(bridge, name: str, param) -> List[Tuple[str, torch.Tensor]]:
    """Every EP rank's copy of the local expert ``name`` (expert-TP shards merged), on every rank:
    ``[(global expert name, tensor)]`` in EP-rank order; collective over expert-TP and EP."""
    from rl_plugin.backends.megatron.moe import expert_global_name

    mpu = bridge.mpu
    tensor = param.detach().contiguous()
    if mpu.etp_size > 1:
        shards = [torch.empty_like(tensor) for _ in range(mpu.etp_size)]
        dist.all_gather(shards, tensor, group=mpu.etp_group)
        tensor = bridge._weight_merge_across_tp(name, shards, param)
    pieces = [tensor]
    if mpu.ep_size > 1:
        pieces = [torch.empty_like(tensor) for _ in range(mpu.ep_size)]
        dist.all_gather(pieces, tensor.contiguous(), group=mpu.ep_group)
    return [(expert_global_name(name, r, _num_local_experts(bridge)), t) for r, t in enumerate(pieces)]


def _experts_to_root(bridge, name: str, param) -> Optional[List[Tuple[str, torch.Tensor]]]:
    """``_experts_to_all`` gathered to the first rank of the expert-TP and EP groups alone
    (``dist.gather``); None on every other rank."""
    from rl_plugin.backends.megatron.moe import expert_global_name

    mpu = bridge.mpu
    tensor = param.detach().contiguous()
    if mpu.etp_size > 1:
        shards = [torch.empty_like(tensor) for _ in range(mpu.etp_size)] if mpu.etp_rank == 0 else None
        dist.gather(tensor, shards, dst=dist.get_global_rank(mpu.etp_group, 0), group=mpu.etp_group)
        if mpu.etp_rank != 0:
            return None
        tensor = bridge._weight_merge_across_tp(name, shards, param)
    pieces = [tensor]
    if mpu.ep_size > 1:
        pieces = [torch.empty_like(tensor) for _ in range(mpu.ep_size)] if mpu.ep_rank == 0 else None
        dist.gather(tensor.contiguous(), pieces, dst=dist.get_global_rank(mpu.ep_group, 0), group=mpu.ep_group)
        if mpu.ep_rank != 0:
            return None
    return [(expert_global_name(name, r, _num_local_experts(bridge)), t) for r, t in enumerate(pieces)]


def stream_hf(bridge, model, *, dp_rank: int, cp_rank: int, host: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
    """The export for the weight sync (module docstring), collective: every rank must exhaust it.
    Global rank 0 gets ``(hf_name, CPU tensor)`` in the order of ``hf_specs``; the other ranks of
    its TP group send their dense shards, the ranks of expert-data-parallel rank 0 (rank 0's EP
    group and their expert-TP peers) their experts; every other rank does nothing. Beyond one
    stage every rank runs mbridge's ``export_weights`` (its collectives span the pipeline) and
    rank 0 keeps it."""
    from mbridge.core.util import unwrap_model
    from megatron.core import parallel_state as mpu

    from rl_plugin.backends.megatron.moe import is_expert_param
    from rl_plugin.backends.megatron.pipeline_export import merged_across_tp

    core = unwrap_model(model)
    if not _one_stage(bridge, core):
        for name, tensor in bridge.export_weights([model]):
            if dist.get_rank() == 0:
                yield name, _out(tensor, host)
        return
    dense_part = dp_rank == 0 and cp_rank == 0
    expert_part = bridge.config.num_moe_experts is not None and mpu.get_expert_data_parallel_rank() == 0
    if not (dense_part or expert_part):
        return
    tp_size, tp_group = bridge.mpu.tp_size, bridge.mpu.tp_group
    exporter = dense_part and bridge.mpu.tp_rank == 0
    if exporter and dist.get_rank() != 0:
        raise RuntimeError(
            f"weight export: TP rank 0 of DP rank 0 is global rank {dist.get_rank()}, not 0; the weight sync "
            "publishes from global rank 0"
        )
    dst = dist.get_global_rank(tp_group, 0) if tp_size > 1 else 0
    global_name = bridge._weight_name_mapping_mcore_local_to_global(core, consider_ep=False)
    for local_name, param in core.named_parameters():
        name = global_name[local_name]
        if is_expert_param(name):
            named = _experts_to_root(bridge, name, param) if expert_part else None
            if named is None:
                continue
        elif not dense_part:
            continue
        else:
            tensor = merged_across_tp(bridge, name, param, exporter=exporter, dst=dst)
            if tensor is None:
                continue
            named = [(name, tensor)]
        for name, tensor in named:
            for hf_name, t in zip(*bridge._weight_to_hf_format(name, tensor)):
                yield hf_name, _out(t, host)


def _out(t: torch.Tensor, host: bool) -> torch.Tensor:
    """An exported tensor as rank 0 yields it: on the CPU, or (``host=False``, a transport that
    sends from the device) where it is."""
    return t.detach().to("cpu") if host else t.detach()


def _export_one_stage(bridge, core) -> Iterator[Tuple[str, torch.Tensor]]:
    """The export at PP = 1 (module docstring): mbridge's ``export_weights`` loop (0.15.1) minus its PP-stage collectives;
    experts gathered over expert-TP and EP (``_experts_to_all``)."""
    from rl_plugin.backends.megatron.moe import is_expert_param

    global_name = bridge._weight_name_mapping_mcore_local_to_global(core, consider_ep=False)
    tp_size, tp_group = bridge.mpu.tp_size, bridge.mpu.tp_group
    for local_name, param in core.named_parameters():
        name = global_name[local_name]
        if is_expert_param(name):
            named = _experts_to_all(bridge, name, param)
        elif getattr(param, "tensor_model_parallel", False):
            shards = [param]
            if tp_size > 1:
                shards = [torch.empty_like(param) for _ in range(tp_size)]
                torch.distributed.all_gather(shards, param, group=tp_group)
            named = [(name, bridge._weight_merge_across_tp(name, shards, param))]
        else:
            named = [(name, param)]
        for name, tensor in named:
            yield from zip(*bridge._weight_to_hf_format(name, tensor))
