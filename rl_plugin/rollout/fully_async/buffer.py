"""The bounded buffer between the fully-async rollout worker and the trainer (miles' data buffer).

One replaceable component with three methods (miles' ``put`` / ``get`` / ``get_metrics``;
``docs/design.md``, "One rollout, as a sequence"): ``put(group)`` keeps a finished, scored group (the producer blocks while the buffer
holds ``capacity`` groups; dynamic sampling has already filtered it), ``get(version)`` returns the
next group that is fresh enough for a trainer at weight version ``version``, waiting while there is
none, and ``metrics()`` the counts since the last call.

Staleness of a group = ``version - min(weight version of any of its tokens)``. ``get`` drops a group
staler than ``max_staleness`` (counted in ``dropped``); with ``handler == "retry"`` its prompt
record goes back to the producer (``requeue``), which generates it again with the current weights.
Groups come out in the order they were put (FIFO: the oldest first, so the least stale training
order the bound allows).

``lock``: the lock the buffer's condition uses, shared with its producer (``producer.py``) so that a
group moves from the producer's in-flight list into the buffer, or from the buffer back to the
producer's queue (``requeue``), in one step that a checkpoint's snapshot never sees half done, and
with one lock there is no lock order to invert. A re-entrant lock: ``requeue`` runs inside ``get``.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional

from rl_plugin.rollout.sample import Sample


@dataclass
class Group:
    """One prompt's finished, scored samples (rewards in ``rewards``, one per sample), the record
    they came from (for ``retry``) and the oldest weight version of any of their tokens."""

    samples: List[Sample]
    rewards: List[float]
    record: Any
    oldest_version: int
    partial: int  # samples whose tokens span more than one weight version

    def staleness(self, version: int) -> int:
        return int(version) - int(self.oldest_version)


class BufferClosed(RuntimeError):
    """The buffer was closed (the run stops) while a caller waited on it."""


class AsyncBuffer:
    def __init__(
        self,
        capacity: int,
        max_staleness: int,
        handler: str = "drop",
        requeue: Optional[Callable[[Any], None]] = None,
        lock: Optional[threading.RLock] = None,
    ):
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1 group (got {capacity})")
        self.capacity, self.max_staleness, self.handler = int(capacity), int(max_staleness), handler
        self.requeue = requeue
        self._groups: Deque[Group] = collections.deque()
        self._cv = threading.Condition(lock if lock is not None else threading.RLock())
        self._closed = False
        self.dropped = 0  # groups dropped as stale since the last ``metrics()``
        self.dropped_total = 0
        self.put_total = 0

    def put(self, group: Group) -> bool:
        """Keep ``group``, waiting while the buffer is full; False when the buffer was closed."""
        with self._cv:
            self._cv.wait_for(lambda: self._closed or len(self._groups) < self.capacity)
            if self._closed:
                return False
            self._groups.append(group)
            self.put_total += 1
            self._cv.notify_all()
            return True

    def offer(self, group: Group) -> bool:
        """``put`` without waiting: False (nothing kept) when the buffer is full or closed."""
        with self._cv:
            if self._closed or len(self._groups) >= self.capacity:
                return False
            self._groups.append(group)
            self.put_total += 1
            self._cv.notify_all()
            return True

    def get(self, version: int, timeout: Optional[float] = None) -> Optional[Group]:
        """The oldest group at most ``max_staleness`` behind ``version``; staler ones are dropped
        (or requeued) on the way. Waits while the buffer is empty; None after ``timeout`` seconds."""
        with self._cv:
            while True:
                while self._groups:
                    group = self._groups.popleft()
                    self._cv.notify_all()
                    if group.staleness(version) <= self.max_staleness:
                        return group
                    self.dropped += 1
                    self.dropped_total += 1
                    if self.handler == "retry" and self.requeue is not None:
                        self.requeue(group.record)
                if self._closed:
                    raise BufferClosed("the fully-async buffer was closed")
                if not self._cv.wait(timeout) and timeout is not None:
                    return None

    def __len__(self) -> int:
        with self._cv:
            return len(self._groups)

    def records(self) -> List[Any]:
        """The prompt records of the groups held now (a checkpoint regenerates them on resume)."""
        with self._cv:
            return [g.record for g in self._groups]

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def metrics(self) -> Dict[str, float]:
        """``async/buffer_groups`` (held now) and ``async/dropped_stale`` (since the last call)."""
        with self._cv:
            out = {"async/buffer_groups": float(len(self._groups)), "async/dropped_stale": float(self.dropped)}
            self.dropped = 0
            return out
