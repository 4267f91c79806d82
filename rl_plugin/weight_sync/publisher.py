"""Train rank 0's side of a sync: versions, tied names, and which transports write.

``publish(state_dict, request)``: the export (every parameter at most once: tied names such as
``lm_head.weight`` sharing the embedding's storage are dropped, the engine's tied parameter
follows its source) becomes sync ``version + 1``. The transports of ``--update-weight-transport``
write it (``transport.py``):

- ``auto``: shared memory for the engines on rank 0's node; the object store for the others (only
  when some engine is elsewhere), or for all when /dev/shm is unusable;
- ``shared_memory`` / ``object_store``: that one alone (shared memory refuses remote engines);
- ``distributed`` (or ``nccl``): a broadcast group from rank 0 to the engine processes; every
  tensor every sync.

The answer is a ``SyncHandle``; under ``--check-weight-sync`` it carries the export's fingerprint.
"""

from __future__ import annotations

import time
from typing import Dict, Optional, Sequence

import torch

from rl_plugin.weight_sync.distributed import DistributedWriter
from rl_plugin.weight_sync.fingerprint import weights_fingerprint
from rl_plugin.weight_sync.handle import SyncHandle, SyncRequest, node_id
from rl_plugin.weight_sync.object_store import ObjectStoreWriter
from rl_plugin.weight_sync.shared_memory import SharedMemoryWriter
from rl_plugin.weight_sync.transport import DISTRIBUTED, TRANSPORTS


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
    def changed_at(self) -> Dict[str, int]:
        """name -> the version of the sync that last changed it (tracked by the shared-memory writer)."""
        return self.shm.changed_at if self.shm is not None else {}

    def publish(self, state_dict: Dict[str, torch.Tensor], request: SyncRequest) -> SyncHandle:
        t0 = time.perf_counter()
        here = node_id()
        sd = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items() if k not in self.skip}
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
        if self.shm is not None:
            self.shm.write(sd, handle, request)
        if self.store is not None and (handle.segment is None or remote):  # what the segment cannot carry
            self.store.write(sd, handle, request)
        if self.dist is not None:
            self.dist.write(sd, handle, request)
        if request.fingerprint:
            handle.fingerprint = weights_fingerprint(state_dict)
        handle.publish_seconds = time.perf_counter() - t0
        return handle

    def close(self) -> None:
        """Unlink the shared-memory segments (teardown)."""
        if self.shm is not None:
            self.shm.close()
