"""Object-store transport: buckets ``ray.put`` once by train rank 0, ``ray.get`` by every engine.

Zero-copy from the object store's shared memory on a node, a network copy across nodes. Under
``auto`` it carries what shared memory cannot: the engines on other nodes, or every engine when
/dev/shm is unusable. Its buckets hold the tensors changed since the version the object-store
engines last loaded (``SyncRequest.since_version``, known only while the shared-memory writer
tracks changes; otherwise everything), so an engine holding another version is refused rather
than left with a partial update.
"""

from __future__ import annotations

from typing import Dict, Iterator

import torch

from rl_plugin.weight_sync.buckets import iter_buckets, tensor_bytes, whole_groups
from rl_plugin.weight_sync.handle import SyncHandle, SyncRequest
from rl_plugin.weight_sync.transport import TransportReader, TransportWriter


class ObjectStoreWriter(TransportWriter):
    name = "object_store"

    def write(self, sd: Dict[str, torch.Tensor], handle: SyncHandle, request: SyncRequest) -> None:
        """Put the buckets of the tensors changed since ``request.since_version`` (whole fused
        groups; everything when the handle has no ``changed_at`` from the shared-memory writer)."""
        import ray

        since = request.since_version if handle.segment is not None else None
        names = list(sd) if since is None else whole_groups([n for n in sd if handle.changed_at[n] > since], list(sd))
        handle.object_refs = [ray.put(b) for b in iter_buckets({n: sd[n] for n in names}, request.buffer_bytes)]
        handle.object_since = since
        handle.sent_bytes += sum(tensor_bytes(sd[n]) for n in names)


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
