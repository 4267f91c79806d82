"""The driver's side of the weight sync: one object that knows which weights the engines hold.

A sync crosses three parties and rides on calls the loop makes anyway::

    driver: request = ledger.request(...)      train call of rollout k  ->  rank 0 publishes v
    driver: ledger.published(handle_v)         (the handle comes back with the step reports)
    driver: handle = ledger.give()             next manager call (generate / evaluate) carries it
    manager/engines: load v, answer the load   (bytes, seconds, fingerprints)
    driver: ledger.loaded(load)                checked against the trainer's fingerprint

The ledger owns the versions and handles between those points: ``engine_version`` (the sync the
engines hold once the calls sent so far ran; None: a full sync is due), ``unsent`` (published, not
yet given to a manager call), ``loading`` (given to the call in flight), the engines' nodes (asked
once per rollout manager), and the seconds both sides spent since the last logged rollout.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

from rl_plugin.errors import LoopError, WeightSyncError, WeightVersionError
from rl_plugin.weight_sync.fingerprint import compare_fingerprints
from rl_plugin.weight_sync.handle import GroupSpec, SyncHandle, SyncRequest
from rl_plugin.weight_sync.settings import SyncSettings
from rl_plugin.weight_sync.transport import DISTRIBUTED


class WeightLedger:
    def __init__(self, settings: SyncSettings):
        self.settings = settings
        self.engine_nodes: Optional[Sequence[str]] = None  # the Ray node id of every engine of the current manager
        self.engine_version: Optional[int] = None
        self.unsent: Optional[SyncHandle] = None
        self.loading: Optional[SyncHandle] = None
        self.load_seconds = 0.0  # engine load time of the calls answered since the last logged rollout
        self.publish_seconds = 0.0  # trainer export + publish time since the last logged rollout
        self.last_version = 0  # the newest sync train rank 0 published (its publisher counts 1, 2, ...)
        self.rendezvous: Optional[tuple] = None  # distributed: (host, port) of train rank 0's store
        self.epoch = 0  # distributed: the set of engines the group is made of (a restart is a new one)

    @property
    def distributed(self) -> bool:
        """The distributed transport: the engines receive while rank 0 publishes (``announce``)."""
        return self.settings.transport in DISTRIBUTED

    def request(self, ask_engine_nodes: Callable[[], Sequence[str]]) -> SyncRequest:
        """What train rank 0 publishes: the changes since the version the manager's engines will
        hold when they load it (everything for a fresh manager); two shared-memory slots when a
        generate may still be loading sync v - 1 while the trainer publishes v (overlapped)."""
        if self.engine_nodes is None:  # asked once per rollout manager
            self.engine_nodes = tuple(ask_engine_nodes())
        s = self.settings
        group = None
        if self.distributed:
            host, port = self.rendezvous
            group = GroupSpec(host=host, port=port, world=1 + len(self.engine_nodes), epoch=self.epoch)
        return SyncRequest(
            buffer_bytes=s.buffer_bytes,
            transport=s.transport,
            engine_nodes=self.engine_nodes,
            since_version=self.engine_version,
            fingerprint=s.fingerprint,
            slots=s.slots,
            group=group,
        )

    def announce(self, request: SyncRequest) -> Optional[SyncHandle]:
        """Distributed: the handle the engines load while rank 0 publishes ``request`` (sent with
        the publishing call, not after it: the broadcast needs both sides); None otherwise."""
        if not self.distributed:
            return None
        return SyncHandle(
            version=self.last_version + 1,
            node_id="",
            buffer_bytes=request.buffer_bytes,
            group=request.group,
            # --check-weight-sync: a fingerprint (empty) asks the engines for theirs; the trainer's
            # comes back with its own handle and is what ``loaded`` compares them with
            fingerprint={} if request.fingerprint else None,
        )

    def published(self, handle: Optional[SyncHandle]) -> None:
        """A train call published ``handle`` (None: it was asked for no sync)."""
        if handle is not None:
            self.unsent, self.last_version = handle, handle.version
            self.publish_seconds += handle.export_seconds + handle.publish_seconds

    def failed(self, handle: SyncHandle) -> None:
        """A distributed sync that did not complete (``handle.error``): its version is used up
        (train rank 0 counted it), nothing was published; the engines are replaced next."""
        self.last_version = max(self.last_version, handle.version)

    def give(self) -> Optional[SyncHandle]:
        """The newest published handle for the manager call about to be sent (None: its engines
        hold the trainer's newest weights already); the manager runs calls in order, so the
        engines hold that version for every later call."""
        handle, self.unsent = self.unsent, None
        if handle is not None:
            self.engine_version = handle.version
        self.loading = handle
        return handle

    def loaded(self, load: Optional[Dict[str, Any]]) -> None:
        """The manager call that was given ``self.loading`` answered ``load`` (bytes, seconds and,
        under --check-weight-sync, every engine's sync version and fingerprint, compared with the
        trainer's: ``WeightVersionError`` for an engine that holds another version, checked first,
        ``WeightSyncError`` for other bits)."""
        handle, self.loading = self.loading, None
        if handle is None:
            return
        if load is None:
            raise LoopError(f"internal: the rollout manager was given sync {handle.version} and answered no load")
        self.load_seconds += load["seconds"]
        if self.settings.fingerprint:
            for i, held in enumerate(load["versions"]):
                if held != handle.version:
                    raise WeightVersionError(
                        f"rollout engine {i} holds weight version {held}, the trainer's is {handle.version}: "
                        "the engine did not load the sync"
                    )
            for i, rollout in enumerate(load["fingerprints"]):
                try:
                    compare_fingerprints(handle.fingerprint, rollout)
                except WeightSyncError as exc:
                    raise WeightSyncError(f"rollout engine {i}: {exc}") from None

    def synced_fully(self, handle: SyncHandle, load: Dict[str, Any]) -> None:
        """A sync call of its own (start-up, a restarted manager) loaded ``handle``: the engines
        hold it, nothing older is pending, and its load time is not a rollout's cost."""
        self.unsent, self.engine_version, self.loading = None, handle.version, handle
        self.last_version = handle.version
        self.loaded(load)
        self.load_seconds = 0.0

    def loaded_while_published(self, handle: SyncHandle, load: Dict[str, Any]) -> None:
        """Distributed: the train call published ``handle`` while the manager loaded it (``announce``):
        the engines hold it, its load is checked, and its times count towards this rollout."""
        self.published(handle)
        self.give()
        self.loaded(load)

    def fresh_engines(self) -> None:
        """A new rollout manager started from the checkpoint: a full sync is due."""
        self.engine_nodes = self.engine_version = self.unsent = self.loading = None
        self.epoch += 1

    def timings(self) -> Dict[str, float]:
        """The weight sync's share of this rollout, measured in the actors: the trainer's export
        and publish in its train call, the engines' loads in the manager calls answered since the
        last rollout was logged (the generate; an eval's load counts towards the next rollout)."""
        out = {
            "time/weight_sync": self.publish_seconds + self.load_seconds,
            "time/weight_publish": self.publish_seconds,
            "time/weight_load_engines": self.load_seconds,
        }
        self.publish_seconds = self.load_seconds = 0.0
        return out
