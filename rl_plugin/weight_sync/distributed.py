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
bucket beyond the stream). A receiver reads the plan, receives the buckets in order and yields
views of them, which the engine loads in place. Unlike the other two transports the receivers
must be inside their load while rank 0 publishes: the driver sends the load (a ``SyncHandle`` it
announces before the publish, ``WeightLedger.announce``) together with the train call. Every
tensor travels every sync (no change tracking, as in slime); tied names never.

Waiting, and the sync's deadline. Sent with the train call, a receiver waits as long as training
takes (old/ref passes and every step of a big model: longer than any fixed timeout). That wait is
not the sync: the receiver polls the store for its version's plan (``store.check`` every
``POLL_S``, no deadline), and between two polls watches ``abort_waits`` (an exit signal) and the
store itself (train rank 0 gone: the poll fails, ``WeightSyncError``). The sync begins when the
plan is there: both sides join the group (built when an epoch's first sync starts, not before)
and broadcast under the sync deadline, ``RL_PLUGIN_WEIGHT_GROUP_TIMEOUT`` seconds (default 600),
the group's collective timeout. A member that dies or stalls mid-sync ends the sync on the others
within that deadline as a ``WeightSyncError``, never a hang and never NCCL's watchdog killing
rank 0: rank 0 drains its export (the other train ranks' gathers complete) and reports the failed
sync in its handle (``SyncHandle.error``); the driver then replaces the rollout manager and its
engines (the fault-tolerance path, ``--max-rollout-retries``), whose full sync is a new epoch.

The store's port: train rank 0 hosts the ``TCPStore`` before anyone is told where
(``host_store``: bound on port 0, the kernel's choice read back, the store kept), so the port the
driver hands the engines is bound once and held; no window where another process can take it.

Untested on GPUs (no GPU in CI): NCCL and vLLM's multi-process workers (``collective_rpc``) are
the GPU path; here the engines run in one process each and receive on the CPU over gloo.
"""

from __future__ import annotations

import datetime
import os
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from rl_plugin.errors import WeightSyncError
from rl_plugin.weight_sync.buckets import plan_buckets, tensor_bytes
from rl_plugin.weight_sync.handle import GroupSpec, SyncHandle, SyncRequest
from rl_plugin.weight_sync.transport import TransportReader, TransportWriter, WriteStream, specs_of, write_all

POLL_S = 0.2  # a receiver's poll of the store while train rank 0 trains
_STORE_CONNECT_S = 60.0  # a receiver's connection to train rank 0's store (it is up before any sync)
_HOSTED: Dict[int, object] = {}  # port -> the TCPStore this process hosts (``host_store``)
_ABORT = threading.Event()  # ``abort_waits``: receivers stop waiting for a plan
# Test hook: "V" makes a receiver's process exit right after the first bucket of sync V (an engine
# dying mid-sync), to exercise the failed sync's path end to end (the manager is replaced).
FAULT_ENV = "RL_PLUGIN_FAULT_KILL_RECEIVER_AT_SYNC"


def sync_deadline_s() -> float:
    """Seconds one sync may take once it began (``RL_PLUGIN_WEIGHT_GROUP_TIMEOUT``, default 600):
    the group's collective timeout. Waiting for the sync to begin has no deadline."""
    return float(os.environ.get("RL_PLUGIN_WEIGHT_GROUP_TIMEOUT", "600"))


def host_store(host: str = "0.0.0.0") -> int:
    """Host a ``TCPStore`` in this process (train rank 0) on a port the kernel picks, keep it, and
    return the port: bound once, held for the process's life (no free-port probe to race)."""
    from torch.distributed import TCPStore

    timeout = datetime.timedelta(seconds=_STORE_CONNECT_S)
    store = TCPStore(host, 0, None, is_master=True, timeout=timeout, wait_for_workers=False)
    _HOSTED[store.port] = store
    return store.port


def abort_waits() -> None:
    """Receivers of this process stop waiting for a sync to begin (an exit signal; the process is
    about to be torn down): their load raises ``WeightSyncError``. It stays set."""
    _ABORT.set()


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

    def store(self, spec: GroupSpec, rank: int):
        """The epoch's store (rank 0: the one ``host_store`` made, else hosted here now)."""
        from torch.distributed import PrefixStore, TCPStore

        if self.tcp is None:
            timeout = datetime.timedelta(seconds=_STORE_CONNECT_S)
            hosted = _HOSTED.get(spec.port) if rank == 0 else None
            self.tcp = hosted or TCPStore(
                spec.host, spec.port, None, is_master=rank == 0, timeout=timeout, wait_for_workers=False
            )
        return PrefixStore(f"rl_plugin_weights/{spec.epoch}", self.tcp)

    def join(self, spec: GroupSpec, rank: int) -> _Group:
        """The epoch's group, built at its first sync (every member joins then), timeout = the deadline."""
        if self.group is not None and self.group.epoch == spec.epoch:
            return self.group
        from torch.distributed import ProcessGroupGloo

        # the group's own timeout is a backstop (NCCL's watchdog): each collective is waited for
        # with the deadline itself (``_wait``), so the sync fails here first, as a WeightSyncError
        store, timeout = self.store(spec, rank), datetime.timedelta(seconds=2 * sync_deadline_s())
        try:
            if torch.cuda.is_available():  # the GPU path: every member must have CUDA
                from torch.distributed import ProcessGroupNCCL

                pg, device = ProcessGroupNCCL(store, rank, spec.world, timeout), torch.device("cuda")
            else:
                pg, device = ProcessGroupGloo(store, rank, spec.world, timeout), torch.device("cpu")
        except RuntimeError as exc:  # a member that never joined in time
            raise _sync_error("forming the group", rank, exc) from None
        self.group = _Group(spec.epoch, store, pg, device)
        return self.group


def _broadcast(group: _Group, buf: torch.Tensor, rank: int, during: str) -> None:
    """One bucket's broadcast, waited for with the sync's deadline. ``wait(timeout)`` blocks on
    NCCL too (without a timeout NCCL's wait only orders the stream, and a dead peer is seen by its
    watchdog alone, which kills the process); a failed NCCL group is aborted (it is never used
    again: the engines are replaced, a new epoch)."""
    try:
        group.pg.broadcast(buf, 0).wait(datetime.timedelta(seconds=sync_deadline_s()))
    except RuntimeError as exc:  # a member died or stalled past the deadline
        abort = getattr(group.pg, "abort", None)
        if group.device.type == "cuda" and abort is not None:
            abort()
        raise _sync_error(during, rank, exc) from None


def _sync_error(during: str, rank: int, exc: BaseException) -> WeightSyncError:
    side = "train rank 0" if rank == 0 else f"engine process {rank}"
    return WeightSyncError(
        f"weight sync (distributed) failed on {side} while {during}: {type(exc).__name__}: {str(exc)[:300]} (a group "
        f"member died or stalled; the sync deadline is RL_PLUGIN_WEIGHT_GROUP_TIMEOUT={sync_deadline_s():g} s)"
    )


Plan = List[List[Tuple[str, str, Tuple[int, ...]]]]  # buckets of (name, dtype, shape)


class DistributedWriter(TransportWriter):
    name = "distributed"

    def __init__(self):
        self.member = _GroupMember()

    def write(self, sd: Dict[str, torch.Tensor], handle: SyncHandle, request: SyncRequest) -> None:
        write_all(self.open(specs_of(sd), handle, request), sd)

    def open(self, specs: Dict[str, torch.Tensor], handle: SyncHandle, request: SyncRequest) -> WriteStream:
        """The plan (from ``specs``) goes to the store at once (the receivers' signal that the sync
        begins), then rank 0 joins the group; each bucket is broadcast as soon as its last tensor
        arrived, so rank 0 holds one bucket beyond the stream, never the model."""
        spec = request.group
        if spec is None:
            raise RuntimeError("--update-weight-transport distributed: the request names no group (internal)")
        buckets = plan_buckets({n: tensor_bytes(t) for n, t in specs.items()}, request.buffer_bytes)
        plan: Plan = [[(n, str(specs[n].dtype), tuple(specs[n].shape)) for n in names] for names in buckets]
        self.member.store(spec, 0).set(f"plan/{handle.version}", pickle.dumps(plan))
        group = self.member.join(spec, 0)
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
            _broadcast(self.group, self.buf, 0, f"sending bucket {self.k + 1} of {len(self.buckets)}")
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
        rank = handle.group_rank
        if rank < 1:
            raise RuntimeError("weight sync: a distributed load needs this engine's rank in the group (internal)")
        plan: Plan = pickle.loads(_wait_for_plan(self.member.store(handle.group, rank), handle.version, rank))
        group = self.member.join(handle.group, rank)
        for k, bucket in enumerate(plan):
            sizes = [torch.Size(shape).numel() * _dtype(dtype).itemsize for _, dtype, shape in bucket]
            buf = torch.empty(sum(sizes), dtype=torch.uint8, device=group.device)
            _broadcast(group, buf, rank, f"receiving bucket {k + 1} of {len(plan)}")
            out, offset = {}, 0
            for (name, dtype, shape), size in zip(bucket, sizes):
                out[name] = buf[offset : offset + size].view(_dtype(dtype)).view(shape)
                offset += size
            yield out
            if os.environ.get(FAULT_ENV) == str(handle.version):
                os._exit(1)


def _wait_for_plan(store, version: int, rank: int) -> bytes:
    """Sync ``version``'s plan, once train rank 0 wrote it: poll (no deadline: training takes what
    it takes), stop on ``abort_waits`` or when the store (train rank 0) is gone."""
    key = f"plan/{version}"
    while True:
        if _ABORT.is_set():
            raise WeightSyncError(f"weight sync (distributed): the wait for sync {version} was aborted (stopping)")
        try:
            if store.check([key]):
                return store.get(key)
        except RuntimeError as exc:  # the store's host, train rank 0, is gone
            raise _sync_error(f"waiting for sync {version} to begin", rank, exc) from None
        time.sleep(POLL_S)
