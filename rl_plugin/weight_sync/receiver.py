"""An engine's side of a sync: the version it holds and the readers of each transport.

``WeightReceiver.buckets(handle)`` picks the transport that serves this engine (shared memory on
train rank 0's node, else the object store, or the distributed group it was given a rank in) and yields the buckets that take the engine from the
version it holds to ``handle.version``; the version is recorded once the last bucket was taken.
``load_sync`` loads them in place (``engine.update_weights(bucket)``) and answers the version the
engine then holds (the driver compares it with the handle's under ``--check-weight-sync`` /
``--ci-test``) and, under ``--check-weight-sync``, fingerprints the engine's weights right after.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Iterator

import torch

from rl_plugin.weight_sync.buckets import tensor_bytes
from rl_plugin.weight_sync.distributed import DistributedReader
from rl_plugin.weight_sync.fingerprint import weights_fingerprint
from rl_plugin.weight_sync.handle import SyncHandle, node_id
from rl_plugin.weight_sync.object_store import ObjectStoreReader
from rl_plugin.weight_sync.shared_memory import SharedMemoryReader


class WeightReceiver:
    def __init__(self):
        self.version = 0  # 0: the weights the engine started from (the checkpoint), not a sync
        self.node = node_id()
        self.readers = (SharedMemoryReader(), ObjectStoreReader(), DistributedReader())  # in order of preference

    def buckets(self, handle: SyncHandle) -> Iterator[Dict[str, torch.Tensor]]:
        """The buckets this engine must load to hold ``handle.version``."""
        reader = next((r for r in self.readers if r.serves(handle, self.node)), None)
        if reader is None:
            raise RuntimeError(
                f"weight sync: this engine (node {self.node}) cannot read train rank 0's shared-memory segment "
                f"{handle.segment} (node {handle.node_id}) and no object-store copy was published; "
                "use --update-weight-transport auto"
            )
        yield from reader.buckets(handle, self.version)
        self.version = handle.version


def load_sync(engine, receiver: WeightReceiver, handle: SyncHandle) -> Dict[str, Any]:
    """Load ``handle`` into ``engine`` in place; bytes, seconds, the sync version the engine holds
    after it (``version``) and, under --check-weight-sync, the fingerprint, for the driver."""
    t0, nbytes = time.perf_counter(), 0
    for bucket in receiver.buckets(handle):
        engine.update_weights(bucket)
        nbytes += sum(tensor_bytes(t) for t in bucket.values())
    out: Dict[str, Any] = {"bytes": float(nbytes), "seconds": time.perf_counter() - t0, "version": receiver.version}
    if handle.fingerprint is not None:
        out["fingerprint"] = weights_fingerprint(engine.weights())
    return out
