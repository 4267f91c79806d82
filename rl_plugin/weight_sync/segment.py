"""The trainer's weights in a POSIX shared-memory segment, read in place by engines on its node.

Layout (``WeightLayout``, computed once from the first export and cached): every exported tensor
gets a slot ``(name, dtype, shape, offset, nbytes)``; slots follow each other in export order,
each offset rounded up to ``ALIGN`` bytes, after a ``HEADER_BYTES`` header. The segment is a file
``/dev/shm/rl_plugin_weights.<pid>.<n>`` of ``layout.total_bytes`` (reserved with
``posix_fallocate``, so a full ``/dev/shm`` fails at creation instead of a SIGBUS on first write),
mapped with ``torch.UntypedStorage.from_file(shared=True)``; the trainer and every reader see the
same pages, so a tensor is a view ``storage[offset : offset + nbytes].view(dtype).view(shape)``
and loading it is one ``param.copy_(view)``.

Header (int64 words): ``MAGIC``, the sync version the data belongs to, the layout's digest. The
writer sets the version to 0 while it writes and to the new version when done; a reader checks
the version before and after reading, so a load that raced a write fails loud. Under overlapped
training the publisher keeps two segments of one layout and alternates them by the sync's
parity (``shared_memory.SharedMemoryWriter``): a reader of sync ``v - 1`` is never overwritten by the
write of ``v``, and the version check still catches a reader two syncs behind.

Cleanup: the creating process unlinks the segment when it is closed or garbage-collected (and at
interpreter exit); a segment whose creator died without that (SIGKILL, OOM) is removed by the next
``create`` on the machine (``sweep_stale``: the pid in the name is no longer running) and by the
run's reaper (``rl_plugin.ray.reaper``), which knows the pids it killed.
"""

from __future__ import annotations

import hashlib
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch

SEGMENT_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "rl_plugin_weights"
HEADER_BYTES = 64
ALIGN = 64  # bytes: any dtype's alignment, and a cache line
MAGIC = 0x524C_5057_5347_4D31  # "RLPWSGM1"


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: str  # "float32", "bfloat16", ...
    shape: Tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class WeightLayout:
    """Where each tensor of the export lives in the segment (see the module docstring)."""

    slots: Tuple[TensorSlot, ...]
    total_bytes: int

    @classmethod
    def of(cls, tensors: Dict[str, torch.Tensor]) -> "WeightLayout":
        slots, offset = [], HEADER_BYTES
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            slots.append(TensorSlot(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        return cls(tuple(slots), offset)

    def fits(self, tensors: Dict[str, torch.Tensor]) -> bool:
        """Same names, order, dtypes and shapes: the export can be written into this layout."""
        if len(tensors) != len(self.slots):
            return False
        return all(
            s.name == n and s.shape == tuple(t.shape) and s.dtype == str(t.dtype).removeprefix("torch.")
            for s, (n, t) in zip(self.slots, tensors.items())
        )

    @property
    def names(self) -> List[str]:
        return [s.name for s in self.slots]

    def digest(self) -> int:
        """A 63-bit hash of the layout: a reader with another layout refuses the segment."""
        text = repr([(s.name, s.dtype, s.shape, s.offset) for s in self.slots]).encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


class SharedWeightSegment:
    """One mapping of a segment (the creator's or a reader's) and its tensor views."""

    def __init__(self, path: Path, layout: WeightLayout, *, owner: bool):
        self.path, self.layout, self.owner = Path(path), layout, owner
        storage = torch.UntypedStorage.from_file(str(self.path), shared=True, nbytes=layout.total_bytes)
        self.bytes = torch.empty(0, dtype=torch.uint8).set_(storage)
        self.header = self.bytes[:HEADER_BYTES].view(torch.int64)
        self.nbytes = {s.name: s.nbytes for s in layout.slots}
        self.views: Dict[str, torch.Tensor] = {
            s.name: self.bytes[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
            for s in layout.slots
        }
        self._finalizer = weakref.finalize(self, _unlink, str(self.path)) if owner else None

    # -- the creator's side ---------------------------------------------------------------------
    @classmethod
    def create(cls, layout: WeightLayout, *, directory: Path = SEGMENT_DIR) -> "SharedWeightSegment":
        """A new segment for ``layout``; ``OSError`` (e.g. ENOSPC) when the directory cannot hold it."""
        directory = Path(directory)
        sweep_stale(directory)
        n = 0
        while (directory / f"{SEGMENT_PREFIX}.{os.getpid()}.{n}").exists():
            n += 1
        path = directory / f"{SEGMENT_PREFIX}.{os.getpid()}.{n}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, layout.total_bytes)  # reserve the pages now: ENOSPC here, not SIGBUS later
        except OSError:
            os.close(fd)
            _unlink(str(path))
            raise
        os.close(fd)
        seg = cls(path, layout, owner=True)
        seg.header[:3] = torch.tensor([MAGIC, 0, layout.digest()])
        return seg

    def begin_write(self) -> None:
        self.header[1] = 0  # readers now refuse the segment until end_write

    def end_write(self, version: int) -> None:
        self.header[1] = version

    def close(self) -> None:
        """Unlink the segment (the creator; readers keep their pages until they drop the mapping)."""
        if self._finalizer is not None:
            self._finalizer()

    # -- a reader's side ------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str, layout: WeightLayout) -> "SharedWeightSegment":
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(
                f"weight sync: the trainer's shared-memory segment {path} is missing (the train rank 0 process died, or "
                "something removed it from /dev/shm); restart the run from its last checkpoint (--load), or pass "
                "--update-weight-transport object_store to sync through Ray's object store"
            )
        size = path.stat().st_size
        if size != layout.total_bytes:
            raise RuntimeError(
                f"weight sync: the shared-memory segment {path} holds {size} bytes, the layout needs "
                f"{layout.total_bytes}: the segment belongs to another layout"
            )
        seg = cls(path, layout, owner=False)
        magic, _, digest = (int(x) for x in seg.header[:3])
        if magic != MAGIC or digest != layout.digest():
            raise RuntimeError(
                f"weight sync: {path} is not the trainer's weight segment for this layout "
                f"(magic {magic:#x}, layout digest {digest:#x} vs {layout.digest():#x})"
            )
        return seg

    def check_version(self, version: int) -> None:
        """Raise unless the segment holds exactly the weights of sync ``version``."""
        have = int(self.header[1])
        if have != version:
            raise RuntimeError(
                f"weight sync: the shared-memory segment {self.path} holds the weights of sync {have} (0: being written), "
                f"this load needs sync {version}: the trainer wrote a new sync while an engine was still loading"
            )


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def segment_pid(path: Path) -> Optional[int]:
    """The creator's pid from a segment's name ``rl_plugin_weights.<pid>.<n>``, else None."""
    parts = Path(path).name.split(".")
    if len(parts) == 3 and parts[0] == SEGMENT_PREFIX and parts[1].isdigit():
        return int(parts[1])
    return None


def sweep_stale(directory: Path = SEGMENT_DIR, dead_pids: Optional[Iterable[int]] = None) -> List[Path]:
    """Unlink the segments whose creator is no longer running (or, given ``dead_pids``, whose
    creator is one of them); returns what was removed."""
    removed = []
    dead = None if dead_pids is None else set(dead_pids)
    try:
        entries = list(Path(directory).glob(f"{SEGMENT_PREFIX}.*"))
    except OSError:
        return removed
    for path in entries:
        pid = segment_pid(path)
        if pid is None or pid == os.getpid():
            continue
        if (pid in dead) if dead is not None else not _running(pid):
            try:
                path.unlink()
            except OSError:  # gone meanwhile, or another user's (sticky /dev/shm): not ours to remove
                continue
            removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
