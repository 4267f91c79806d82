"""Shared-memory transport: engines on train rank 0's node copy straight from a POSIX segment.

Writer (train rank 0): the segment (``segment.py``) is created at the first sync with the layout
of the export and reused while the layout fits. It also decides what changed: the slot holding
sync ``v - 1`` is the last sync's weights, so each exported tensor is compared with it bitwise
(``changed_bitwise``) and ``changed_at[name]`` becomes the version of the sync that last changed
it. A fused group travels whole, a tied name never (the publisher drops it).

Double buffering (``SyncRequest.slots = 2``, overlapped training): sync ``v`` goes into slot
``v % 2``, so an engine still loading sync ``v - 1`` from the other slot is never overwritten by
the publish of ``v``. Each slot remembers the version it holds (``slot_version``); writing ``v``
into a slot that holds ``w`` copies every tensor with ``changed_at > w`` (changed at any sync
after ``w``, not only at ``v``). With one slot (the synchronous loop) ``w = v - 1``: the same rule
writes exactly what changed.

Reader (an engine on the same node): maps each slot once, checks the segment's version before
and after reading (a load that raced a write fails loud) and yields views of the tensors with
``changed_at`` above the version it holds: one ``param.copy_(view)`` per tensor, no
serialisation, no second copy.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional

import torch

from rl_plugin.weight_sync.buckets import changed_bitwise, plan_buckets, tensor_bytes, whole_groups
from rl_plugin.weight_sync.handle import SyncHandle, SyncRequest
from rl_plugin.weight_sync.segment import SharedWeightSegment, WeightLayout
from rl_plugin.weight_sync.transport import TransportReader, TransportWriter


class SharedMemoryWriter(TransportWriter):
    """Train rank 0's segments. ``strict`` (``--update-weight-transport shared_memory``): an
    unusable /dev/shm raises; otherwise (``auto``) the writer records why (``failed``) and writes
    nothing from then on, and the object store carries the weights."""

    name = "shared_memory"

    def __init__(self, *, strict: bool):
        self.strict = strict
        self.layout: Optional[WeightLayout] = None
        self.slots: List[SharedWeightSegment] = []  # the segments, sync v in slots[v % len(slots)]
        self.slot_version: List[int] = []  # the sync each slot holds (0: not written yet)
        self.changed_at: Dict[str, int] = {}
        self.failed: Optional[str] = None  # why auto fell back to the object store

    def write(self, sd: Dict[str, torch.Tensor], handle: SyncHandle, request: SyncRequest) -> None:
        """Write sync ``handle.version`` into its slot (the segments created, or re-created on a new
        layout or slot count) and point ``handle`` at it; ``handle.segment`` stays None when
        /dev/shm is unusable under ``auto``."""
        if self.failed is not None or not self._ensure_slots(sd, request.slots):
            return
        v, slots = handle.version, request.slots
        prev = (v - 1) % slots  # holds sync v - 1 unless nothing was written yet
        before = self.slots[prev].views if self.slot_version[prev] == v - 1 else None
        for name, value in sd.items():
            if before is None or name not in self.changed_at or changed_bitwise(before[name], value):
                self.changed_at[name] = v
        slot = v % slots
        seg, held = self.slots[slot], self.slot_version[slot]
        written = [n for n in sd if self.changed_at[n] > held]  # everything the slot missed since it held `held`
        seg.begin_write()
        for name in written:
            seg.views[name].copy_(sd[name])
        seg.end_write(v)
        self.slot_version[slot] = v
        handle.layout, handle.segment, handle.changed_at = self.layout, str(seg.path), dict(self.changed_at)
        handle.sent_bytes += sum(tensor_bytes(sd[n]) for n in written)

    def _ensure_slots(self, sd: Dict[str, torch.Tensor], slots: int) -> bool:
        """The segments exist with a layout that fits ``sd``; False when /dev/shm cannot hold them
        (under ``auto``; raised under ``shared_memory``)."""
        if self.layout is not None and self.layout.fits(sd) and len(self.slots) == slots:
            return True
        self.close()
        layout = WeightLayout.of(sd)
        try:
            for _ in range(slots):
                self.slots.append(SharedWeightSegment.create(layout))
        except OSError as exc:
            self.close()
            why = (
                f"cannot create {slots} x {layout.total_bytes / 2**20:.1f} MiB shared-memory segment(s) "
                f"in /dev/shm ({exc})"
            )
            if self.strict:
                raise RuntimeError(
                    f"--update-weight-transport shared_memory: {why}; enlarge /dev/shm (docker --shm-size) "
                    "or use --update-weight-transport object_store"
                ) from None
            self.failed = why
            print(f"weight sync: {why}; the object store carries the weights instead", flush=True)
            return False
        self.layout, self.changed_at, self.slot_version = layout, {}, [0] * slots
        return True

    def close(self) -> None:
        """Unlink the segments (teardown, or a new layout)."""
        for seg in self.slots:
            seg.close()
        self.slots, self.slot_version, self.layout = [], [], None


class SharedMemoryReader(TransportReader):
    """An engine's mappings of train rank 0's segments (one per slot)."""

    def __init__(self):
        self.layout: Optional[WeightLayout] = None
        self.segments: Dict[str, SharedWeightSegment] = {}  # path -> mapping

    def serves(self, handle: SyncHandle, node: str) -> bool:
        return handle.segment is not None and handle.node_id == node

    def buckets(self, handle: SyncHandle, held: int) -> Iterator[Dict[str, torch.Tensor]]:
        if handle.layout != self.layout:  # a new layout (the publisher's first sync, or a new model)
            self.segments, self.layout = {}, handle.layout
            held = 0  # everything in it is news to this engine
        seg = self.segments.get(handle.segment)
        if seg is None:
            if len(self.segments) >= 2:  # the publisher re-created its slots: drop the old mappings
                self.segments = {}
            seg = self.segments[handle.segment] = SharedWeightSegment.open(handle.segment, handle.layout)
        seg.check_version(handle.version)
        names = whole_groups([n for n in seg.layout.names if handle.changed_at[n] > held], seg.layout.names)
        for bucket in plan_buckets({n: seg.nbytes[n] for n in names}, handle.buffer_bytes):
            yield {n: seg.views[n] for n in bucket}
        seg.check_version(handle.version)  # the trainer did not write meanwhile
