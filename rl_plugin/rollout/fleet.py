"""The rollout's engine fleet: its engines, the weights they hold, and their sleep / wake.

One component the rollout manager owns (``rollout/manager.py``) and every source calls through
these methods: the single ``hf`` engine in the manager's process (``engine``), or the engine
actors (``actors``, ``rl_plugin.ray.engine_actor``). A weight sync (``rl_plugin.weight_sync``)
loads into every engine in place: ``start_load`` sends it (the in-process engine loads at once;
an actor runs its calls in order, so a later call to it runs after the load), ``finish_load``
answers it (bytes, the slowest engine's seconds, the versions and fingerprints under --check-weight-sync);
``load_paused`` is the fully-async form for engine actors (each pauses its own generation at a
token boundary). Colocated (``--colocate``) the engines sleep between calls and wake for a load
(weights only) or a generation (the KV cache too).

``version`` is the trainer weight version the engines hold (the trainer's rollout index: rollout
k trains weights of version k), recorded by whoever loads and knows it (the run's start-up and
restart syncs, a fully-async take or eval); None when no load said. Fully async labels each
token with it, so it must be the version of the weights that draw the tokens, never the next one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence

from rl_plugin.phases import record
from rl_plugin.weight_sync import SyncHandle, WeightReceiver, load_sync, node_id

Loading = Optional[List[Any]]  # a load in progress: the in-process engine's stats, or the actors' ObjectRefs


def for_receiver(handle: SyncHandle, rank: int) -> SyncHandle:
    """The handle as engine ``rank - 1`` reads it: its rank in the distributed group (ranks 1..E;
    train rank 0 broadcasts), unchanged for the other transports."""
    return replace(handle, group_rank=rank) if handle.group is not None else handle


def answer(handle: SyncHandle, stats: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A load's answer from every engine's stats: the bytes (one engine's), the slowest engine's
    seconds and, under --check-weight-sync, every engine's sync version and fingerprint."""
    out: Dict[str, Any] = {"bytes": stats[0]["bytes"], "seconds": max(s["seconds"] for s in stats)}
    if handle.fingerprint is not None:
        out["versions"] = [s["version"] for s in stats]
        out["fingerprints"] = [s["fingerprint"] for s in stats]
    return out


class EngineFleet:
    def __init__(self, engine: Any, actors: Sequence[Any], *, colocated: bool):
        self.engine = engine  # the in-process engine (None: the engines are actors)
        self.actors = list(actors)
        self.colocated = colocated  # the engines sleep between calls (docs/design.md, "Colocation")
        self.receiver = WeightReceiver() if engine is not None else None
        self.version: Optional[int] = None

    def node_ids(self) -> List[str]:
        """The Ray node id of every engine process (this one's when the engine lives here): train
        rank 0 publishes through shared memory to the engines on its node."""
        if self.engine is not None:
            return [node_id()]
        import ray

        return ray.get([e.node_id.remote() for e in self.actors])

    def load(self, handle: SyncHandle, version: Optional[int] = None) -> Dict[str, Any]:
        """Load ``handle`` (weights of trainer version ``version``) into every engine and wait;
        colocated, the engines sleep again after it."""
        out = self.finish_load(handle, self.start_load(handle), version)
        self.sleep()
        return out

    def start_load(self, handle: Optional[SyncHandle], *, generating: bool = False) -> Loading:
        """The in-process engine loads ``handle`` now; engine actors are sent the load. Colocated,
        the engines wake first: their weights for the load, the rest (KV cache) only when
        ``generating``. None: no handle, nothing loads."""
        loading = None
        if handle is not None:
            self._colocated("wake_up", ("weights",))
            record(f"engine.load {handle.version}")
            if self.engine is not None:
                loading = [load_sync(self.engine, self.receiver, for_receiver(handle, 1))]
            else:
                loading = [e.update_weights.remote(for_receiver(handle, i + 1)) for i, e in enumerate(self.actors)]
        if generating:
            self._colocated("wake_up", None)
        return loading

    def finish_load(
        self, handle: Optional[SyncHandle], loading: Loading, version: Optional[int] = None
    ) -> Optional[Dict[str, Any]]:
        """The answer of a load ``start_load`` began (None: none was); the engines now hold trainer
        version ``version``."""
        if loading is None:
            return None
        if self.engine is None:
            import ray

            stats = ray.get(loading)  # every engine's stats
        else:
            stats = loading  # the in-process engine's, loaded in start_load
        self.version = version
        return answer(handle, stats)

    def load_paused(self, handle: SyncHandle, version: int) -> Dict[str, Any]:
        """Fully async, engine actors: each loads ``handle`` at its generation's next token boundary
        (its ``weights`` thread, ``EngineActor.update_weights_paused``); its later tokens carry
        ``version``."""
        import ray

        refs = [
            e.update_weights_paused.options(concurrency_group="weights").remote(for_receiver(handle, i + 1), version)
            for i, e in enumerate(self.actors)
        ]
        out = answer(handle, ray.get(refs))
        self.version = version
        return out

    def sleep(self) -> None:
        """Colocated: free the engines' device memory (a sleep is waited for, so the training ranks
        start on freed memory)."""
        self._colocated("sleep")

    def abort(self) -> None:
        """Abort the engine actors' generations (on their ``control`` thread)."""
        for e in self.actors:
            e.abort.options(concurrency_group="control").remote()

    def _colocated(self, method: str, *args) -> None:
        """Colocated only: ``sleep`` / ``wake_up`` on every engine, in order with their other calls."""
        if not self.colocated:
            return
        record(f"engine.{method}" + (f" {','.join(args[0])}" if args and args[0] else ""))
        if self.engine is not None:
            getattr(self.engine, method)(*args)
            return
        refs = [getattr(e, method).remote(*args) for e in self.actors]
        if method == "sleep":
            import ray

            ray.get(refs)
