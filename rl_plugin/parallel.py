"""ParallelState: the parallel layout the loss core is told about, never looks up.

A backend builds one from its own world (megatron-core's ``parallel_state``, or a torch
``DeviceMesh``) and passes it down. The loss core only reads sizes, ranks and the explicit
process groups here, so it runs under plain gloo with no Megatron at all.

Groups and what crosses them:

- ``dp_group``: ranks holding *different samples* and the same model shard. Global counts
  (N, P, token totals) are summed over it.
- ``cp_group``: ranks holding *different chunks of the same samples*. GSPO's per-sample partial
  sums and the CP gather cross it.
- ``tp_group``: ranks holding *different vocab shards of the same tokens*. Vocab-parallel
  log-prob / entropy scalars cross it.
- ``dp_cp_group``: the union of DP and CP (Megatron's ``with_context_parallel=True``). The
  step's loss contributions and metric sums are summed over it; TP ranks hold replicas.
- ``pp_group``: ranks holding *different layers* (pipeline stages) of the same samples. Only the
  last stage computes log-probs and the loss; its per-token results (forward-only log-probs) are
  broadcast to the other stages over ``pp_group`` (loss-device tensors) and its step report over
  ``pp_cpu_group`` (its gloo twin: a pickled dict). ``pp_last_rank``: the last stage's global
  rank (the broadcasts' source).

A group of size 1 may be ``None``; every collective helper here is a no-op then.

Devices (the runner's device contract, ``rl_plugin.loss.runner``): ``tp_group`` and ``cp_group``
carry tensors on the loss device (the logits' device: NCCL on GPU, gloo on CPU); ``dp_group`` and
``dp_cp_group`` carry only CPU scalars (step counts, the micro-batch plan, metric vectors), so
they must be gloo groups: ``cpu_group`` gives the gloo twin of a group of another backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

ProcessGroup = Optional["dist.ProcessGroup"]


@dataclass(frozen=True)
class ParallelState:
    dp_size: int = 1
    dp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    dp_group: ProcessGroup = None
    cp_group: ProcessGroup = None
    tp_group: ProcessGroup = None
    dp_cp_group: ProcessGroup = None
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: ProcessGroup = None
    pp_cpu_group: ProcessGroup = None
    pp_last_rank: int = 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the model's last layers (the head): the loss runs here."""
        return self.pp_rank == self.pp_size - 1

    def __post_init__(self) -> None:
        if self.pp_size > 1 and (self.pp_group is None or self.pp_cpu_group is None):
            raise ValueError(f"ParallelState: pp_size={self.pp_size} > 1 needs a pp_group and a pp_cpu_group")
        for name in ("dp", "cp", "tp", "pp"):
            size, rank = getattr(self, f"{name}_size"), getattr(self, f"{name}_rank")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"ParallelState: {name}_rank={rank} is outside [0, {name}_size={size})")
            if size > 1 and getattr(self, f"{name}_group") is None:
                raise ValueError(f"ParallelState: {name}_size={size} > 1 needs a {name}_group")
        if self.dp_size * self.cp_size > 1 and self.dp_cp_group is None:
            raise ValueError("ParallelState: dp_size * cp_size > 1 needs a dp_cp_group")

    @classmethod
    def single(cls) -> "ParallelState":
        """The layout of one process: every size 1, no groups."""
        return cls()

    @classmethod
    def from_world(cls, *, tp: int = 1, cp: int = 1, dp: Optional[int] = None) -> "ParallelState":
        """Build groups over the default torch.distributed world in Megatron's order.

        Rank = tp_rank + tp * (cp_rank + cp * dp_rank) (tp fastest, then cp, then dp), the
        order megatron-core uses by default (``tp-cp-ep-dp-pp`` with ep = pp = 1). Every rank
        must call this collectively: ``new_group`` is a collective.
        """
        world = dist.get_world_size()
        rank = dist.get_rank()
        dp = dp if dp is not None else world // (tp * cp)
        if tp * cp * dp != world:
            raise ValueError(f"tp={tp} x cp={cp} x dp={dp} != world size {world}")

        def coords(r: int) -> tuple[int, int, int]:
            return r % tp, (r // tp) % cp, r // (tp * cp)

        def build(key) -> ProcessGroup:
            mine = None
            buckets: dict = {}
            for r in range(world):
                buckets.setdefault(key(coords(r)), []).append(r)
            for members in buckets.values():  # new_group is collective: create all, keep ours
                group = dist.new_group(members) if len(members) > 1 else None
                if rank in members:
                    mine = group
            return mine

        t, c, d = coords(rank)
        return cls(
            dp_size=dp,
            dp_rank=d,
            cp_size=cp,
            cp_rank=c,
            tp_size=tp,
            tp_rank=t,
            tp_group=build(lambda x: (x[1], x[2])),
            cp_group=build(lambda x: (x[0], x[2])),
            dp_group=build(lambda x: (x[0], x[1])),
            dp_cp_group=build(lambda x: x[0]),
        )


def cpu_group(group: ProcessGroup) -> ProcessGroup:
    """A gloo group with the ranks of ``group`` (the group itself when it is already gloo).

    Collective over the WORLD when a twin is built: every rank all-gathers its group's rank list
    and creates every distinct list in the same order (``new_group`` is collective)."""
    if group is not None and dist.get_backend(group) == "gloo":
        return group
    mine = dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]
    lists = [None] * dist.get_world_size()
    dist.all_gather_object(lists, sorted(mine))
    twin = None
    for ranks in sorted({tuple(x) for x in lists}):
        g = dist.new_group(list(ranks), backend="gloo")
        if dist.get_rank() in ranks:
            twin = g
    return twin


def all_reduce(tensor: torch.Tensor, group: ProcessGroup, op=None) -> torch.Tensor:
    """In-place all-reduce (SUM by default) that is a no-op for a ``None`` group.

    Not differentiable: for counts, metrics and reported values. See ``rl_plugin.loss.comm``
    for the autograd-aware collectives.
    """
    if group is not None:
        dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=group)
    return tensor


def broadcast_from_last_stage(tensor: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """``tensor`` as the last pipeline stage holds it, on every stage (in place; a no-op at one
    stage). Every stage passes a tensor of the same shape and dtype (on the loss device)."""
    if ps.pp_size > 1:
        dist.broadcast(tensor, src=ps.pp_last_rank, group=ps.pp_group)
    return tensor


def broadcast_object_from_last_stage(obj, ps: ParallelState):
    """The last pipeline stage's ``obj`` (a small picklable value) on every stage, over the gloo
    ``pp_cpu_group``; ``obj`` itself at one stage."""
    if ps.pp_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=ps.pp_last_rank, group=ps.pp_cpu_group)
    return box[0]


def virtual_pipeline_size(
    num_layers: int, pp: int, *, layers_per_chunk: Optional[int] = None, chunks_per_rank: Optional[int] = None
) -> Optional[int]:
    """The model chunks per pipeline rank of the interleaved schedule (megatron-core's
    ``virtual_pipeline_model_parallel_size``), from one of Megatron-LM's two flags:
    ``--num-layers-per-virtual-pipeline-stage N`` (V = layers / (P x N)) or
    ``--num-virtual-stages-per-pipeline-rank V``. None: neither flag, one chunk per stage (1F1B).
    The layers must split evenly into P x V chunks, and P > 1; else ``RLArgumentError`` naming the
    flag and the sizes that work."""
    from rl_plugin.errors import fail

    if layers_per_chunk is None and chunks_per_rank is None:
        return None
    flag = (
        f"--num-layers-per-virtual-pipeline-stage {layers_per_chunk}"
        if layers_per_chunk is not None
        else f"--num-virtual-stages-per-pipeline-rank {chunks_per_rank}"
    )
    if pp < 2:
        fail(
            f"{flag} with --pipeline-model-parallel-size {pp}",
            "the interleaved schedule interleaves model chunks over pipeline stages, and there is one stage",
            "add --pipeline-model-parallel-size 2 (or more), or drop the virtual pipeline flag",
        )
    per_rank = num_layers // pp if num_layers % pp == 0 else None
    if layers_per_chunk is not None:
        size = per_rank // layers_per_chunk if per_rank and per_rank % layers_per_chunk == 0 else None
    else:
        size = chunks_per_rank if per_rank and per_rank % chunks_per_rank == 0 else None
    # the fixes are stated in the units of the flag given: layers per chunk N, or chunks per rank V
    fits = [d for d in range(1, (per_rank or 0) + 1) if per_rank % d == 0]
    fits = [d for d in fits if d < per_rank] if layers_per_chunk is not None else [d for d in fits if d >= 2]
    name = flag.split()[0]
    if size is None:
        fail(
            f"{flag} with --pipeline-model-parallel-size {pp}",
            f"the model's {num_layers} layers do not split evenly into {pp} stages x equal chunks of that size",
            f"use {name} with one of {', '.join(map(str, fits))} ({per_rank} layers per stage)"
            if fits
            else f"use a --pipeline-model-parallel-size that divides {num_layers} into stages of 2 layers or more",
        )
    if size < 2:
        fail(
            f"{flag} with --pipeline-model-parallel-size {pp}",
            f"that is one chunk of {per_rank} layers per stage, the plain 1F1B schedule",
            f"drop the virtual pipeline flag, or use {name} with one of {', '.join(map(str, fits))}"
            if fits
            else "drop the virtual pipeline flag",
        )
    return size
