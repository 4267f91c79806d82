"""Distributed transport (``--update-weight-transport distributed``; ``nccl`` is the same): train
rank 0 broadcasts each bucket to every engine process over a torch.distributed group made for the
purpose (gloo on CPU, NCCL where both sides have CUDA), as slime and verl do on GPUs.

The group: rank 0 is train rank 0 (it hosts the ``TCPStore``, at the address the driver got from
it once), ranks 1..E the engine processes (the rollout manager itself when the engine lives
there). A fresh set of engines (a restarted rollout manager) is a new ``epoch``: a new group under
its own store prefix, the old one dropped.

One sync, version v: rank 0 writes the bucket plan (name, dtype, shape of every tensor, bucket by
bucket; ``plan_buckets``, a fused group whole) into the store under ``plan/v``, then broadcasts
each bucket as one flat byte tensor as soon as the export stream filled it (rank 0 holds one
bucket beyond the stream). A receiver reads the plan (waiting for it), receives the
buckets in order and yields views of them, which the engine loads in place. Unlike the other two
transports the receivers must be inside their load while rank 0 publishes: the driver sends the
load (a ``SyncHandle`` it announces before the publish, ``WeightLedger.announce``) together with
the train call. Every tensor travels every sync (no change tracking, as in slime); tied names
never.

Untested on GPUs (no GPU in CI): NCCL and vLLM's multi-process workers (``collective_rpc``) are
the GPU path; here the engines run in one process each and receive on the CPU over gloo.
"""

from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from rl_plugin.weight_sync.buckets import plan_buckets, tensor_bytes
from rl_plugin.weight_sync.handle import GroupSpec, SyncHandle, SyncRequest
from rl_plugin.weight_sync.transport import TransportReader, TransportWriter, WriteStream, specs_of, write_all

TIMEOUT_S = float(os.environ.get("RL_PLUGIN_WEIGHT_GROUP_TIMEOUT", "600"))  # a receiver that never comes


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.rsplit(".", 1)[-1])


@dataclass
class _Group:
    epoch: int
    store: object  # the epoch's PrefixStore
    pg: object  # ProcessGroupGloo / ProcessGroupNCCL
    device: torch.device


class _GroupMember:
    """One process's membership: the TCPStore (hosted by rank 0) and the group of the current epoch."""

    def __init__(self):
        self.tcp = None
        self.group: Optional[_Group] = None

    def join(self, spec: GroupSpec, rank: int) -> _Group:
        if self.group is not None and self.group.epoch == spec.epoch:
            return self.group
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        if self.tcp is None:
            self.tcp = TCPStore(
                spec.host, spec.port, None, is_master=rank == 0, timeout=timeout, wait_for_workers=False
            )
        store = PrefixStore(f"rl_plugin_weights/{spec.epoch}", self.tcp)
        if torch.cuda.is_available():  # the GPU path: every member must have CUDA
            from torch.distributed import ProcessGroupNCCL

            pg, device = ProcessGroupNCCL(store, rank, spec.world, timeout), torch.device("cuda")
        else:
            pg, device = ProcessGroupGloo(store, rank, spec.world, timeout), torch.device("cpu")
        self.group = _Group(spec.epoch, store, pg, device)
        return self.group


Plan = List[List[Tuple[str, str, Tuple[int, ...]]]]  # buckets of (name, dtype, shape)


class DistributedWriter(TransportWriter):
    name = "distributed"

    def __init__(self):
        self.member = _GroupMember()

    def write(self, sd: Dict[str, torch.Tensor], handle: SyncHandle, request: SyncRequest) -> None:
        write_all(self.open(specs_of(sd), handle, request), sd)

    def open(self, specs: Dict[str, torch.Tensor], handle: SyncHandle, request: SyncRequest) -> WriteStream:
        """The plan (from ``specs``) goes to the store at once; each bucket is broadcast as soon as
        its last tensor arrived, so rank 0 holds one bucket beyond the stream, never the model."""
        spec = request.group
        if spec is None:
            raise RuntimeError("--update-weight-transport distributed: the request names no group (internal)")
        group = self.member.join(spec, 0)
        buckets = plan_buckets({n: tensor_bytes(t) for n, t in specs.items()}, request.buffer_bytes)
        plan: Plan = [[(n, str(specs[n].dtype), tuple(specs[n].shape)) for n in names] for names in buckets]
        group.store.set(f"plan/{handle.version}", pickle.dumps(plan))
        handle.group = spec
        return _BroadcastStream(group, buckets, {n: tensor_bytes(t) for n, t in specs.items()}, handle)


class _BroadcastStream(WriteStream):
    """Tensors in plan order into the current bucket's buffer; a full bucket is broadcast."""

    def __init__(self, group: _Group, buckets: List[List[str]], sizes: Dict[str, int], handle: SyncHandle):
        self.group, self.buckets, self.sizes, self.handle = group, buckets, sizes, handle
        self.k, self.i, self.offset, self.buf = 0, 0, 0, None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.k >= len(self.buckets) or name != self.buckets[self.k][self.i]:
            expected = self.buckets[self.k][self.i] if self.k < len(self.buckets) else "nothing more"
            raise RuntimeError(f"weight sync (distributed): the export gave {name!r} where the plan has {expected!r}")
        if self.buf is None:
            total = sum(self.sizes[n] for n in self.buckets[self.k])
            self.buf = torch.empty(total, dtype=torch.uint8, device=self.group.device)
        size = self.sizes[name]
        self.buf[self.offset : self.offset + size].copy_(tensor.reshape(-1).view(torch.uint8))
        self.offset += size
        self.i += 1
        if self.i == len(self.buckets[self.k]):  # the bucket is complete: every engine receives it now
            self.group.pg.broadcast(self.buf, 0).wait()
            self.handle.sent_bytes += self.offset
            self.k, self.i, self.offset, self.buf = self.k + 1, 0, 0, None

    def close(self) -> None:
        if self.k != len(self.buckets):
            raise RuntimeError(
                f"weight sync (distributed): the export ended after {self.k} of {len(self.buckets)} buckets; the engines "
                "wait for the rest until RL_PLUGIN_WEIGHT_GROUP_TIMEOUT"
            )


class DistributedReader(TransportReader):
    def __init__(self):
        self.member = _GroupMember()

    def serves(self, handle: SyncHandle, node: str) -> bool:
        return handle.group is not None

    def buckets(self, handle: SyncHandle, held: int) -> Iterator[Dict[str, torch.Tensor]]:
        if handle.group_rank < 1:
            raise RuntimeError("weight sync: a distributed load needs this engine's rank in the group (internal)")
        group = self.member.join(handle.group, handle.group_rank)
        plan: Plan = pickle.loads(group.store.get(f"plan/{handle.version}"))
        for bucket in plan:
            sizes = [torch.Size(shape).numel() * _dtype(dtype).itemsize for _, dtype, shape in bucket]
            buf = torch.empty(sum(sizes), dtype=torch.uint8, device=group.device)
            group.pg.broadcast(buf, 0).wait()
            out, offset = {}, 0
            for (name, dtype, shape), size in zip(bucket, sizes):
                out[name] = buf[offset : offset + size].view(_dtype(dtype)).view(shape)
                offset += size
            yield out
