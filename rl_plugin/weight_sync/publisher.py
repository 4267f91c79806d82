"""Train rank 0's side of a sync: versions, tied names, and which transports write.

``publish(state_dict, request)``: the export (every parameter at most once: tied names such as
``lm_head.weight`` sharing the embedding's storage are dropped, the engine's tied parameter
follows its source) becomes sync ``version + 1``. The transports of ``--update-weight-transport``
write it (``transport.py``):

- ``auto``: shared memory for the engines on rank 0's node; the object store for the others (only
  when some engine is elsewhere), or for all when /dev/shm is unusable;
- ``shared_memory`` / ``object_store``: that one alone (shared memory refuses remote engines);
- ``distributed`` (or ``nccl``): a broadcast group from rank 0 to the engine processes; every
  tensor every sync, copied from where the export has it into the bucket on the group's device
  (never through the host when the transport is NCCL).

The answer is a ``SyncHandle``; under ``--check-weight-sync`` it carries the export's fingerprint.

``publish_stream(specs, tensors, request)``: the same from a stream of ``(name, tensor)`` in
export order (a backend's ``stream_hf_weights``), described up front by ``specs`` (meta tensors,
``hf_weight_specs``): each tensor is fingerprinted, written into the segment and added to the
object store's current bucket as it arrives, then dropped, so rank 0 never holds a second copy
of the model (the peak beyond the model is one bucket). ``publish`` is ``publish_stream`` over a dict.
"""

from __future__ import annotations

import time
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch

from rl_plugin.weight_sync.distributed import DistributedWriter
from rl_plugin.weight_sync.fingerprint import tensor_fingerprint
from rl_plugin.weight_sync.handle import SyncHandle, SyncRequest, node_id
from rl_plugin.weight_sync.object_store import ObjectStoreWriter
from rl_plugin.weight_sync.shared_memory import SharedMemoryWriter
from rl_plugin.weight_sync.transport import DISTRIBUTED, TRANSPORTS, specs_of


class WeightPublisher:
    def __init__(self, transport: str = "auto", *, skip: Sequence[str] = ()):
        if transport not in TRANSPORTS:
            raise ValueError(f"--update-weight-transport {transport!r}: unknown; choose from {', '.join(TRANSPORTS)}")
        self.transport = transport
        self.skip = set(skip)  # tied names: the engine's tied parameter follows its source
        self.version = 0
        self.shm: Optional[SharedMemoryWriter] = (
            SharedMemoryWriter(strict=transport == "shared_memory") if transport in ("auto", "shared_memory") else None
        )
        self.store: Optional[ObjectStoreWriter] = ObjectStoreWriter() if transport in ("auto", "object_store") else None
        self.dist: Optional[DistributedWriter] = DistributedWriter() if transport in DISTRIBUTED else None

    @property
    def host_tensors(self) -> bool:
        """Whether the transports want the export on the CPU: shared memory and the object store
        do; the distributed group alone copies each tensor from where it is into its bucket on the
        group's device (NCCL: GPU to GPU), so a backend streams it from the device
        (``stream_hf_weights(host=False)``)."""
        return self.shm is not None or self.store is not None

    @property
    def changed_at(self) -> Dict[str, int]:
        """name -> the version of the sync that last changed it (tracked by the shared-memory writer)."""
        return self.shm.changed_at if self.shm is not None else {}

    def publish(self, state_dict: Dict[str, torch.Tensor], request: SyncRequest) -> SyncHandle:
        return self.publish_stream(specs_of(state_dict), state_dict.items(), request)

    def publish_stream(
        self,
        specs: Dict[str, torch.Tensor],
        tensors: Iterable[Tuple[str, torch.Tensor]],
        request: SyncRequest,
    ) -> SyncHandle:
        """Publish sync ``version + 1`` from ``tensors`` (``(name, tensor)`` in the order of
        ``specs``, tied names included: they are fingerprinted, not sent). The time spent inside
        ``tensors`` counts as publishing too; the caller may split it off (``export_seconds``)."""
        t0 = time.perf_counter()
        here = node_id()
        self.version += 1
        remote = any(n != here for n in request.engine_nodes)
        if self.transport == "shared_memory" and remote:
            far = sorted({n for n in request.engine_nodes if n != here})
            raise RuntimeError(
                f"--update-weight-transport shared_memory: rollout engines run on node(s) {far}, not on train "
                f"rank 0's node {here}; shared memory reaches one machine only. Use --update-weight-transport auto "
                "(the object store for the other nodes)"
            )
        handle = SyncHandle(version=self.version, node_id=here, buffer_bytes=request.buffer_bytes)
        kept = {n: s for n, s in specs.items() if n not in self.skip}
        streams = []
        if self.shm is not None:
            streams.append(self.shm.open(kept, handle, request))
        if self.store is not None and (handle.segment is None or remote):  # what the segment cannot carry
            streams.append(self.store.open(kept, handle, request))
        if self.dist is not None:  # collects the stream, then broadcasts bucket by bucket at close
            streams.append(self.dist.open(kept, handle, request))
        streams = [s for s in streams if s is not None]
        fingerprint: Optional[Dict[str, str]] = {} if request.fingerprint else None
        host = self.host_tensors  # the distributed group alone: no round trip through the host
        try:
            for name, tensor in tensors:
                if fingerprint is not None:
                    fingerprint[name] = tensor_fingerprint(tensor)
                if name in self.skip:
                    continue
                tensor = (tensor.detach().to("cpu") if host else tensor.detach()).contiguous()
                for stream in streams:
                    stream.add(name, tensor)
                del tensor  # the streams keep what they still need (one bucket at most)
            for stream in streams:
                stream.close()
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        if fingerprint is not None:
            handle.fingerprint = dict(sorted(fingerprint.items()))
        handle.publish_seconds = time.perf_counter() - t0
        return handle

    def close(self) -> None:
        """Unlink the shared-memory segments (teardown)."""
        if self.shm is not None:
            self.shm.close()
