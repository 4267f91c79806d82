"""The rollout manager's engine weights: loading a weight sync into every engine (in process or
engine actors) and, colocated (``--colocate``), the engines' sleep / wake around it.

``EngineWeights`` is a mixin of ``RolloutManager`` (``rollout/manager.py``): it reads the
manager's ``engine`` (the in-process engine, or None), ``engines`` (engine actors), ``receiver``
and ``colocated``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Optional

from rl_plugin.phases import record
from rl_plugin.weight_sync import SyncHandle, load_sync, node_id


def _for_receiver(handle: SyncHandle, rank: int) -> SyncHandle:
    """The handle as engine ``rank - 1`` reads it: its rank in the distributed group (ranks 1..E;
    train rank 0 broadcasts), unchanged for the other transports."""
    return replace(handle, group_rank=rank) if handle.group is not None else handle


class EngineWeights:
    def engine_node_ids(self) -> List[str]:
        """The Ray node id of every engine process (this actor's when the engine lives here):
        train rank 0 publishes through shared memory to the engines on its node."""
        if self.engine is not None:
            return [node_id()]
        import ray

        return ray.get([e.node_id.remote() for e in self.engines])

    def update_weights(self, handle: SyncHandle) -> Dict[str, Any]:
        """Load the sync behind ``handle`` (``rl_plugin.weight_sync``) into every engine,
        in place; returns the bytes per engine, the slowest engine's seconds and, under
        --check-weight-sync, every engine's fingerprint (``fingerprints``)."""
        out = self._finish_load(handle, self._start_load(handle))
        self._sleep()
        return out

    def _start_load(self, handle: Optional[SyncHandle], *, generating: bool = False) -> Optional[List[Any]]:
        """The in-process engine loads ``handle`` now (its stats); engine actors are sent the load
        (their ObjectRefs: later calls to them run after it). Colocated, the engines wake first:
        their weights for the load, the rest (KV cache) only when ``generating``."""
        loading = None
        if handle is not None:
            self._engines("wake_up", ("weights",))
            record(f"engine.load {handle.version}")
            if self.engine is not None:
                loading = [load_sync(self.engine, self.receiver, _for_receiver(handle, 1))]
            else:
                loading = [e.update_weights.remote(_for_receiver(handle, i + 1)) for i, e in enumerate(self.engines)]
        if generating:
            self._engines("wake_up", None)
        return loading

    def _engines(self, method: str, *args) -> None:
        """Colocated only (``--colocate``): ``sleep`` / ``wake_up`` on every engine, in order with
        their other calls (an engine actor runs its calls in order; a sleep is waited for, so the
        training ranks start on freed memory)."""
        if not self.colocated:
            return
        record(f"engine.{method}" + (f" {','.join(args[0])}" if args and args[0] else ""))
        if self.engine is not None:
            getattr(self.engine, method)(*args)
            return
        refs = [getattr(e, method).remote(*args) for e in self.engines]
        if method == "sleep":
            import ray

            ray.get(refs)

    def _sleep(self) -> None:
        self._engines("sleep")

    def _finish_load(self, handle: Optional[SyncHandle], loading: Optional[List[Any]]) -> Optional[Dict[str, Any]]:
        """``update_weights``'s answer for a load ``_start_load`` began (None: none was)."""
        if loading is None:
            return None
        if self.engine is None:
            import ray

            stats = ray.get(loading)  # every engine's stats
        else:
            stats = loading  # the in-process engine's, loaded in _start_load
        out: Dict[str, Any] = {"bytes": stats[0]["bytes"], "seconds": max(s["seconds"] for s in stats)}
        if handle.fingerprint is not None:
            out["fingerprints"] = [s["fingerprint"] for s in stats]
        return out
