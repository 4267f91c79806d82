"""What travels between the three parties of a sync (driver, train rank 0, engines).

- ``SyncRequest``: the driver asks train rank 0 to publish (built by ``WeightLedger.request``).
- ``SyncHandle``: train rank 0's answer, small enough to pass through Ray: the version, and where
  each transport put the tensors (the shared-memory segment and its layout, the object-store
  buckets, the distributed group). The rollout manager hands it to every engine, whose
  ``WeightReceiver`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from rl_plugin.weight_sync.segment import WeightLayout


def node_id() -> str:
    """This process's Ray node id ("local" outside Ray: every process then shares one machine; also
    where Ray is not installed, e.g. the in-process GPU check, ``tests/gpu``)."""
    try:
        import ray
    except ImportError:
        return "local"

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


@dataclass(frozen=True)
class GroupSpec:
    """The distributed transport's group: train rank 0 hosts the store at ``host:port``; ``world``
    is 1 + the engine processes; ``epoch`` counts the sets of engines (a restart is a new group)."""

    host: str
    port: int
    world: int
    epoch: int


@dataclass(frozen=True)
class SyncRequest:
    """What the driver asks train rank 0 to publish for one sync."""

    buffer_bytes: int  # --update-weight-buffer-size
    transport: str = "auto"  # --update-weight-transport
    engine_nodes: Sequence[str] = ()  # the Ray node id of every engine process (asked once per rollout manager)
    since_version: Optional[int] = None  # the version the object-store engines hold (None: send everything)
    fingerprint: bool = False  # --check-weight-sync
    slots: int = 1  # shared-memory buffers: 2 when an engine may load sync v - 1 while v is published
    group: Optional[GroupSpec] = None  # the distributed transport's group


@dataclass
class SyncHandle:
    """A published sync, small enough to pass through Ray: where to read each tensor from."""

    version: int
    node_id: str  # train rank 0's node
    buffer_bytes: int
    layout: Optional[WeightLayout] = None  # shared memory: the segment's layout and path
    segment: Optional[str] = None
    changed_at: Dict[str, int] = field(default_factory=dict)  # name -> version of the sync that last changed it
    object_refs: Optional[List[Any]] = None  # object store: the buckets, tensors changed after object_since
    object_since: Optional[int] = None
    group: Optional[GroupSpec] = None  # distributed: the group the buckets are broadcast in
    group_rank: int = 0  # distributed: the receiving engine's rank in it (set by the rollout manager)
    fingerprint: Optional[Dict[str, str]] = None  # --check-weight-sync: the trainer's, of this export
    sent_bytes: int = 0  # bytes written into the segment / put in the object store by rank 0
    publish_seconds: float = 0.0
    export_seconds: float = 0.0  # the backend's collective export before the publish (set by the train actor)
    error: Optional[str] = None  # distributed: the sync failed mid-way (a member died or stalled; nothing loaded)
