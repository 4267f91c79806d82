"""Shared-memory transport: engines on train rank 0's node copy straight from a POSIX segment.

Writer (train rank 0): the segment (``segment.py``) is created at the first sync with the layout
of the export and reused while the layout fits. It also decides what changed: the slot holding
sync ``v - 1`` is the last sync's weights, so each exported tensor is compared with it bitwise
(``changed_bitwise``) and ``changed_at[name]`` becomes the version of the sync that last changed
it. A fused group travels whole, a tied name never (the publisher drops it).

Streaming (``open``): the layout comes from the export's specs (meta tensors), so each tensor is
compared and written as the backend's stream yields it; a sync that fails part way leaves its
slot marked "being written" (version 0) and rewritten whole by the next sync.

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
from rl_plugin.weight_sync.transport import TransportReader, TransportWriter, WriteStream, specs_of, write_all


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
        write_all(self.open(specs_of(sd), handle, request), sd)

    def open(self, specs: Dict[str, torch.Tensor], handle: SyncHandle, request: SyncRequest) -> Optional[WriteStream]:
        """``write`` tensor by tensor: the layout comes from ``specs`` (meta tensors), each added
        tensor is compared with the last sync's and copied into the slot if the slot misses it.
        None (nothing written) when /dev/shm is unusable under ``auto``."""
        if self.failed is not None or not self._ensure_slots(specs, request.slots):
            return None
        return _SlotStream(self, handle, request.slots)

    def _ensure_slots(self, sd: Dict[str, torch.Tensor], slots: int) -> bool:
        """The segments exist with a layout that fits ``sd`` (tensors or meta specs); False when /dev/shm cannot hold them
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


class _SlotStream(WriteStream):
    """Sync ``v`` written into slot ``v % slots`` as the export streams in (module docstring):
    each tensor is compared with the slot holding ``v - 1`` before anything overwrites it, and
    copied when the slot being written holds an older copy (``changed_at > held``)."""

    def __init__(self, writer: SharedMemoryWriter, handle: SyncHandle, slots: int):
        v = handle.version
        prev, slot = (v - 1) % slots, v % slots
        self.writer, self.handle, self.version, self.slot = writer, handle, v, slot
        self.before = writer.slots[prev].views if writer.slot_version[prev] == v - 1 else None
        self.seg, self.held = writer.slots[slot], writer.slot_version[slot]
        self.expected = iter(writer.layout.slots)
        self.sent = 0
        self.seg.begin_write()
        writer.slot_version[slot] = 0  # partly written until close: an aborted sync leaves it to be rewritten whole
        # The object store's stream reads which tensors changed as they pass (live until close).
        handle.layout, handle.segment, handle.changed_at = writer.layout, str(self.seg.path), writer.changed_at

    def add(self, name: str, tensor: torch.Tensor) -> None:
        spec = next(self.expected, None)
        dtype = str(tensor.dtype).removeprefix("torch.")
        if spec is None or spec.name != name or spec.shape != tuple(tensor.shape) or spec.dtype != dtype:
            raise RuntimeError(
                f"weight sync: the export streamed {name!r} {tuple(tensor.shape)} {dtype} where the layout expects "
                f"{'nothing more' if spec is None else (spec.name, spec.shape, spec.dtype)}: the backend's "
                "hf_weight_specs and its stream_hf_weights disagree"
            )
        changed_at = self.writer.changed_at
        if self.before is None or name not in changed_at or changed_bitwise(self.before[name], tensor):
            changed_at[name] = self.version
        if changed_at[name] > self.held:  # everything the slot missed since it held `held`
            self.seg.views[name].copy_(tensor)
            self.sent += tensor_bytes(tensor)

    def close(self) -> None:
        missing = [s.name for s in self.expected]
        if missing:
            raise RuntimeError(
                f"weight sync: the export ended before {len(missing)} tensor(s) of its layout (first {missing[0]!r}): "
                "the backend's stream_hf_weights yields less than its hf_weight_specs"
            )
        self.seg.end_write(self.version)
        self.writer.slot_version[self.slot] = self.version
        self.handle.changed_at = dict(self.writer.changed_at)
        self.handle.sent_bytes += self.sent

    def abort(self) -> None:
        self.handle.layout = self.handle.segment = None


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
