"""The weight export of a pipelined model (``--pipeline-model-parallel-size`` > 1).

Each stage holds its own layers (the embedding on the first, the final norm and output layer on
the last), named by megatron with the stage's local layer numbers; mbridge maps them to global
HF names (``_weight_name_mapping_mcore_local_to_global``). A tied model's last stage holds a
copy of the embedding as ``output_layer.weight`` (kept equal through megatron's embedding
group); it is left out, since the first stage exports the embedding under the same HF name.
Under the interleaved schedule a stage holds several model chunks (``chunks.py``); ``cores`` is
their list and a stage's share is its chunks' tensors in chunk order (so the stream's layers run
stage by stage, e.g. 0, 2, 1, 3 at PP2 x VPP2 of four layers: the names, not the order, place them).

- ``all_stage_specs`` / ``pipeline_specs``: the export's names, shapes and dtypes, stage after
  stage (collective over the pipeline, once per run: one ``all_gather_object`` of each stage's
  list, on the gloo ``pp_cpu_group``), as meta tensors; the same answer on every rank.
- ``stream_gathered_to_rank0`` (the weight sync's stream): FALLBACK, NOT a per-stage publish.
  Only the DP rank 0 / CP rank 0 replica takes part. On each stage the TP group gathers a
  parameter's shards to its TP rank 0 (as at one stage, ``bridge.stream_hf``), which converts it
  to HF tensors; stage 0's TP rank 0 (global rank 0) yields its own, then receives every later
  stage's tensors in ``pipeline_specs`` order (``dist.send`` / ``dist.recv`` on the default
  group: gloo on CPU, NCCL on GPU; consecutive tensors of one dtype packed into messages of at
  most ``MESSAGE_BYTES``, ``message_groups``, so a small model is one message per stage, not one
  per tensor), and yields them. So global rank 0 alone publishes (every transport works
  unchanged), its peak is one message, and no rank gathers the whole model;
  what a per-stage publish would add is that the stages' exporters write their own buckets in
  parallel instead of sending them through rank 0.
"""

from __future__ import annotations

import math
from typing import Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist

Spec = Tuple[str, Tuple[int, ...], torch.dtype]
MESSAGE_BYTES = 32 << 20  # the most a stage sends rank 0 in one message (a larger tensor goes alone)


def _stage_params(bridge, cores) -> Iterator[Tuple[str, torch.nn.Parameter]]:
    """``(global megatron name, parameter)`` of this stage's share of the export: its model
    chunks' in virtual-stage order (one chunk without the interleaved schedule)."""
    for core in cores:
        global_name = bridge._weight_name_mapping_mcore_local_to_global(core, consider_ep=False)
        tied_copy = core.share_embeddings_and_output_weights and not core.pre_process
        for local_name, param in core.named_parameters():
            if tied_copy and local_name == "output_layer.weight":
                continue
            yield global_name[local_name], param


def _stage_specs(bridge, cores) -> List[Spec]:
    """This stage's HF tensors (name, shape, dtype), from meta tensors: nothing materialised."""
    out: List[Spec] = []
    for name, param in _stage_params(bridge, cores):
        tensor = torch.empty(param.shape, dtype=param.dtype, device="meta")
        if getattr(param, "tensor_model_parallel", False):
            tensor = bridge._weight_merge_across_tp(name, [tensor] * bridge.mpu.tp_size, param)
        for hf_name, t in zip(*bridge._weight_to_hf_format(name, tensor)):
            out.append((hf_name, tuple(t.shape), t.dtype))
    return out


def all_stage_specs(bridge, cores, pp_cpu_group) -> List[List[Spec]]:
    """Every stage's ``_stage_specs``, in stage order; collective over the pipeline. The layout
    never changes during a run, so a backend asks once and passes the answer to the two below."""
    stages: List = [None] * dist.get_world_size(pp_cpu_group)
    dist.all_gather_object(stages, _stage_specs(bridge, cores), group=pp_cpu_group)
    return stages


def pipeline_specs(stages: List[List[Spec]]) -> Dict[str, torch.Tensor]:
    """Meta tensors of the whole export in stream order (module docstring)."""
    return {name: torch.empty(shape, dtype=dtype, device="meta") for stage in stages for name, shape, dtype in stage}


def _stage_tensors(bridge, cores, *, exporter: bool) -> Iterator[Tuple[str, torch.Tensor]]:
    """This stage's HF tensors at its TP rank 0 (``exporter``); the other TP ranks send shards."""
    tp_size, tp_group = bridge.mpu.tp_size, bridge.mpu.tp_group
    dst = dist.get_global_rank(tp_group, 0) if tp_size > 1 else dist.get_rank()
    for name, param in _stage_params(bridge, cores):
        tensor = merged_across_tp(bridge, name, param, exporter=exporter, dst=dst)
        if tensor is not None:
            yield from zip(*bridge._weight_to_hf_format(name, tensor))


def merged_across_tp(bridge, name: str, param: torch.Tensor, *, exporter: bool, dst: int):
    """``param`` whole (its megatron name ``name``) at TP rank 0 of the TP group (``exporter``,
    global rank ``dst``): a TP-split parameter's shards are gathered there and merged by mbridge;
    one TP does not split is the parameter itself. Collective over the TP group for a split
    parameter; None on every rank but the exporter."""
    if getattr(param, "tensor_model_parallel", False):
        tp_size, tp_group = bridge.mpu.tp_size, bridge.mpu.tp_group
        shards = [param]
        if tp_size > 1:
            shards = [torch.empty_like(param) for _ in range(tp_size)] if exporter else None
            dist.gather(param.detach().contiguous(), shards, dst=dst, group=tp_group)
        return bridge._weight_merge_across_tp(name, shards, param) if exporter else None
    return param if exporter else None


def stream_gathered_to_rank0(
    bridge, cores, stages: List[List[Spec]], *, dp_rank: int, cp_rank: int, pp_group, host: bool = True
):
    """The weight sync's export of a pipelined model (module docstring: the fallback through
    global rank 0), ``stages`` from ``all_stage_specs``. Collective: every rank must exhaust it;
    global rank 0 gets ``(hf_name, CPU tensor)`` in ``pipeline_specs`` order (``host=False``: on
    the device), every other rank nothing."""
    if dp_rank != 0 or cp_rank != 0:
        return
    exporter = bridge.mpu.tp_rank == 0
    tensors = _stage_tensors(bridge, cores, exporter=exporter)
    if dist.get_rank() != 0:  # a later stage's TP rank 0 sends to rank 0; its TP peers only gather
        with torch.no_grad():
            send_stage(tensors, stages[bridge.mpu.pp_rank] if exporter else [])
        return
    yield from stream_to_rank0(tensors, stages, dist.get_process_group_ranks(pp_group), cores[0], host)


def message_groups(stage: List[Spec], budget: int = MESSAGE_BYTES) -> List[List[int]]:
    """The stage's specs cut into messages: runs of consecutive tensors of one dtype of at most
    ``budget`` bytes together (a larger tensor alone). Both ends compute it from the same specs."""
    groups: List[List[int]] = []
    size, dtype = 0, None
    for i, (_, shape, dt) in enumerate(stage):
        nbytes = math.prod(shape) * dt.itemsize
        if not groups or dt != dtype or size + nbytes > budget:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
        dtype = dt
    return groups


def send_stage(tensors, stage: List[Spec]) -> None:
    """A later stage's exporter: its HF tensors to rank 0, one message per ``message_groups``."""
    it = iter(tensors)
    for group in message_groups(stage):
        flat = []
        for i in group:
            name, t = next(it)
            if name != stage[i][0]:
                raise RuntimeError(f"pipeline export: stage tensor {name!r} where its layout expects {stage[i][0]!r}")
            flat.append(t.detach().reshape(-1))
        dist.send(torch.cat(flat) if len(flat) > 1 else flat[0].contiguous(), dst=0)
    for _ in it:  # a TP peer (empty ``stage``): its share of the gathers, nothing to send
        pass


def stream_to_rank0(own, stages, exporters, core, host: bool = True):
    """Rank 0: its own stage's tensors, then each later stage's, received message by message."""
    for name, t in without_grad(own):
        yield name, t.detach().to("cpu") if host else t.detach()
    device = next(core.parameters()).device
    for stage, src in zip(stages[1:], exporters[1:]):
        for group in message_groups(stage):
            numels = [math.prod(stage[i][1]) for i in group]
            buf = torch.empty(sum(numels), dtype=stage[group[0]][2], device=device)
            dist.recv(buf, src=src)
            for i, piece in zip(group, buf.split(numels)):
                name, shape, _ = stage[i]
                yield name, piece.view(shape).to("cpu") if host else piece.view(shape)


def without_grad(gen):
    """Each step of ``gen`` under ``torch.no_grad`` (a ``with`` around a ``yield`` would leak the
    mode into the caller between steps)."""
    while True:
        with torch.no_grad():
            try:
                item = next(gen)
            except StopIteration:
                return
        yield item
