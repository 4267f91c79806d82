"""Object-store transport: buckets ``ray.put`` once by train rank 0, ``ray.get`` by every engine.

Zero-copy from the object store's shared memory on a node, a network copy across nodes. Under
``auto`` it carries what shared memory cannot: the engines on other nodes, or every engine when
/dev/shm is unusable. Its buckets hold the tensors changed since the version the object-store
engines last loaded (``SyncRequest.since_version``, known only while the shared-memory writer
tracks changes; otherwise everything), so an engine holding another version is refused rather
than left with a partial update.

Streaming (``open``): each bucket is put as soon as it is full, so train rank 0 holds at most one
bucket (plus a fused group still waiting for its last part) beyond the tensor it receives. The
buckets are ``plan_buckets``'s: the groups in the order of their first tensor, a group whole.
The object store itself still holds every changed bucket until the engines have read them.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Dict, Iterator, List

import torch

from rl_plugin.weight_sync.buckets import fused_group, tensor_bytes
from rl_plugin.weight_sync.handle import SyncHandle, SyncRequest
from rl_plugin.weight_sync.transport import TransportReader, TransportWriter, WriteStream, specs_of, write_all


class ObjectStoreWriter(TransportWriter):
    name = "object_store"

    def write(self, sd: Dict[str, torch.Tensor], handle: SyncHandle, request: SyncRequest) -> None:
        """Put the buckets of the tensors changed since ``request.since_version`` (whole fused
        groups; everything when the handle has no ``changed_at`` from the shared-memory writer)."""
        write_all(self.open(specs_of(sd), handle, request), sd)

    def open(self, specs: Dict[str, torch.Tensor], handle: SyncHandle, request: SyncRequest) -> WriteStream:
        """``write`` tensor by tensor: each bucket is put once it is full (module docstring)."""
        return _BucketStream(specs, handle, request)


class _BucketStream(WriteStream):
    """The buckets of ``plan_buckets`` over the changed groups, put as they fill. A group is
    taken once all its tensors arrived, in the order of its first tensor in ``specs``; it is
    sent when any of its tensors changed after ``since`` (the shared-memory stream, which sees
    each tensor first, keeps ``handle.changed_at`` current), or always when ``since`` is None."""

    def __init__(self, specs: Dict[str, torch.Tensor], handle: SyncHandle, request: SyncRequest):
        if request.buffer_bytes < 1:
            raise ValueError(f"--update-weight-buffer-size must be >= 1 byte (got {request.buffer_bytes})")
        self.handle, self.budget = handle, request.buffer_bytes
        self.since = request.since_version if handle.segment is not None else None
        groups: Dict[str, List[str]] = {}
        for name in specs:
            groups.setdefault(fused_group(name), []).append(name)
        self.groups = deque(groups.values())
        self.names = set(specs)
        self.arrived: Dict[str, torch.Tensor] = {}
        self.bucket: Dict[str, torch.Tensor] = {}
        self.used, self.sent = 0, 0
        self.refs: List[Any] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.names or name in self.arrived:
            raise RuntimeError(f"weight sync: the export streamed {name!r}, which its specs do not list (or twice)")
        self.arrived[name] = tensor
        while self.groups and all(n in self.arrived for n in self.groups[0]):
            self._take(self.groups.popleft())

    def _take(self, names: List[str]) -> None:
        tensors = {n: self.arrived.pop(n) for n in names}
        if self.since is not None and not any(self.handle.changed_at[n] > self.since for n in names):
            return
        nbytes = sum(tensor_bytes(t) for t in tensors.values())
        if self.bucket and self.used + nbytes > self.budget:
            self._put()
        self.bucket.update(tensors)
        self.used += nbytes

    def _put(self) -> None:
        import ray

        self.refs.append(ray.put(self.bucket))
        self.sent += self.used
        self.bucket, self.used = {}, 0

    def close(self) -> None:
        if self.groups:
            raise RuntimeError(
                f"weight sync: the export ended before {self.groups[0][0]!r} (and {len(self.groups) - 1} more group(s)) "
                "of its specs arrived"
            )
        if self.arrived:  # a tensor of a group already sent: streamed twice
            raise RuntimeError(f"weight sync: the export streamed {next(iter(self.arrived))!r} twice")
        if self.bucket:
            self._put()
        self.handle.object_refs, self.handle.object_since = self.refs, self.since
        self.handle.sent_bytes += self.sent

    def abort(self) -> None:
        self.refs, self.bucket, self.arrived = [], {}, {}


class ObjectStoreReader(TransportReader):
    def serves(self, handle: SyncHandle, node: str) -> bool:
        return handle.object_refs is not None

    def buckets(self, handle: SyncHandle, held: int) -> Iterator[Dict[str, torch.Tensor]]:
        if handle.object_since is not None and handle.object_since != held:
            raise RuntimeError(
                f"weight sync: this engine holds sync {held} but the object store carries the changes "
                f"since sync {handle.object_since}; the driver must request a full sync (since_version None)"
            )
        import ray

        for ref in handle.object_refs:
            yield ray.get(ref)
