"""The adapters' export (issue 34): ``(canonical PEFT name, full fp32 tensor)`` at global rank 0,
the way ``bridge.stream_hf`` / ``pipeline_export`` export the full model.

Only the DP rank 0 / CP rank 0 replica takes part. On each pipeline stage the TP group gathers a
TP-split adapter tensor's shards to its TP rank 0 (``dist.gather``; column-parallel B split by
rows, row-parallel A by columns, ``lora.LoraAdapters.partition_dim``) and concatenates them; a
replicated tensor is TP rank 0's own. Stage 0's TP rank 0 (global rank 0) yields its own stage's
tensors, then every later stage's, sent to it in bounded messages with the same layout exchange
as the full model's pipelined export (``pipeline_export.message_groups`` / ``send_stage`` /
``stream_to_rank0``; the per-stage layout is asked once, ``adapter_stage_specs``). Every rank must
exhaust the stream; the others get nothing. The tensors are copies (adapters are small), so they
stay valid after the next optimizer step.

``adapter_specs``: the export's names, shapes and dtypes (meta tensors), for the weight sync's
``hf_weight_specs`` counterpart.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

from rl_plugin.backends.megatron import pipeline_export
from rl_plugin.backends.megatron.lora_model import local_adapters


def _full_shape(param: torch.Tensor, module, which: str) -> Tuple[int, ...]:
    dim = module.partition_dim(which)
    shape = list(param.shape)
    if dim is not None:
        shape[dim] *= module.tp_size
    return tuple(shape)


def stage_specs(model) -> List[pipeline_export.Spec]:
    """This stage's adapters as (canonical name, full shape, float32), in export order."""
    return [(name, _full_shape(p, m, which), torch.float32) for name, p, m, which in local_adapters(model)]


def adapter_stage_specs(model, pp_cpu_group) -> List[List[pipeline_export.Spec]]:
    """Every stage's ``stage_specs``, in stage order; collective over the pipeline (gloo group)."""
    if pp_cpu_group is None or dist.get_world_size(pp_cpu_group) == 1:
        return [stage_specs(model)]
    stages: List = [None] * dist.get_world_size(pp_cpu_group)
    dist.all_gather_object(stages, stage_specs(model), group=pp_cpu_group)
    return stages


def adapter_specs(stages: List[List[pipeline_export.Spec]]) -> Dict[str, torch.Tensor]:
    return pipeline_export.pipeline_specs(stages)


def _gathered(param: torch.Tensor, module, which: str, *, exporter: bool):
    """The full fp32 tensor at TP rank 0 (None elsewhere); collective over TP for a split one."""
    dim = module.partition_dim(which)
    if dim is None or module.tp_size == 1:  # a copy: the stream's tensors outlive the next step
        return param.detach().to(torch.float32, copy=True) if exporter else None
    local = param.detach().float().contiguous()
    group = module.tp_group
    shards = [torch.empty_like(local) for _ in range(module.tp_size)] if exporter else None
    dist.gather(local, shards, dst=dist.get_global_rank(group, 0), group=group)
    return torch.cat(shards, dim=dim) if exporter else None


def _stage_tensors(model, *, exporter: bool) -> Iterator[Tuple[str, torch.Tensor]]:
    for name, param, module, which in local_adapters(model):
        tensor = _gathered(param, module, which, exporter=exporter)
        if tensor is not None:
            yield name, tensor


def stream_adapters(model, stages, *, dp_rank: int, cp_rank: int, tp_rank: int, pp_rank: int, pp_group):
    """The adapter stream (module docstring); ``stages`` from ``adapter_stage_specs``."""
    if dp_rank != 0 or cp_rank != 0:
        return
    exporter = tp_rank == 0
    tensors = _stage_tensors(model, exporter=exporter)
    with torch.no_grad():
        if dist.get_rank() != 0:  # a later stage's TP rank 0 sends to rank 0; its TP peers only gather
            pipeline_export.send_stage(tensors, stages[pp_rank] if exporter else [])
            return
    if len(stages) == 1:
        for name, t in tensors:
            yield name, t.to("cpu")
        return
    core = next(iter(p for _, p, _, _ in local_adapters(model)), None)
    yield from pipeline_export.stream_to_rank0(tensors, stages, dist.get_process_group_ranks(pp_group), _DeviceOf(core))


class _DeviceOf:
    """What ``stream_to_rank0`` reads off a core: ``parameters()`` for the receive buffers' device."""

    def __init__(self, param):
        self.param = param if param is not None else torch.empty(0)

    def parameters(self):
        return iter([self.param])
