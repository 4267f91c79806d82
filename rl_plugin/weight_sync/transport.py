"""The transport interface: how one sync's tensors get from train rank 0 to an engine.

A transport has two halves. Its ``Writer`` lives in train rank 0's process: ``write`` puts the
tensors of sync ``handle.version`` somewhere the engines can read and records where in the handle.
Its ``Reader`` lives in an engine's process: ``serves`` says whether the handle carries data this
engine can read through it, ``buckets`` yields the buckets to load (at most
``handle.buffer_bytes`` each, a fused group whole). ``WeightPublisher`` and ``WeightReceiver``
compose them (``--update-weight-transport``); the implementations are ``shared_memory.py`` (same
node), ``object_store.py`` (any node) and ``distributed.py`` (a collective group; GPU).

Streaming (a backend's export arrives tensor by tensor, so train rank 0 never holds a second
copy of the model): ``open(specs, handle, request)`` starts writing sync ``handle.version`` and
returns a ``WriteStream``; the publisher ``add``s each ``(name, tensor)`` in the order of
``specs`` (an ordered dict of meta tensors: the names, shapes and dtypes of the export, known
before any tensor is materialised) and ``close``s it. A writer that cannot stream keeps the
default ``open``, which collects the tensors and calls ``write`` once at ``close``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Dict, Iterator, Optional

import torch

from rl_plugin.registries import DISTRIBUTED_TRANSPORTS, WEIGHT_TRANSPORTS
from rl_plugin.weight_sync.handle import SyncHandle, SyncRequest

# --update-weight-transport's choices (the flag layer reads them without importing torch)
TRANSPORTS, DISTRIBUTED = WEIGHT_TRANSPORTS, DISTRIBUTED_TRANSPORTS


def specs_of(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The export's specs: one meta tensor (shape, dtype) per name, in the same order."""
    return {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in tensors.items()}


class WriteStream(ABC):
    """One sync being written tensor by tensor (``TransportWriter.open``)."""

    @abstractmethod
    def add(self, name: str, tensor: torch.Tensor) -> None:
        """The next tensor of the export (contiguous; on the CPU unless the distributed group alone
        writes, then where the export has it), in the order of the specs."""

    @abstractmethod
    def close(self) -> None:
        """Every tensor was added: make the sync readable and record it in the handle."""

    def abort(self) -> None:  # noqa: B027 - optional: only streams that hold something override it
        """The export failed part way: leave nothing that a reader could take for a sync."""


class TransportWriter(ABC):
    """Train rank 0's half of a transport."""

    name: str = ""

    @abstractmethod
    def write(self, sd: Dict[str, torch.Tensor], handle: SyncHandle, request: SyncRequest) -> None:
        """Make ``sd`` (CPU, contiguous, tied names dropped) readable as sync ``handle.version``
        and record where in ``handle`` (adding the bytes it wrote to ``handle.sent_bytes``)."""

    def open(self, specs: Dict[str, torch.Tensor], handle: SyncHandle, request: SyncRequest) -> Optional[WriteStream]:
        """Start writing sync ``handle.version`` from a stream of the tensors ``specs`` describes
        (tied names dropped); None when this writer takes no part in the sync. By default the
        tensors are collected and ``write`` runs at ``close`` (a writer that cannot stream)."""
        return _Collected(self, handle, request)

    def close(self) -> None:  # noqa: B027 - optional: only writers that hold something override it
        """Free what the writer holds (teardown); nothing by default."""


class TransportReader(ABC):
    """An engine's half of a transport."""

    @abstractmethod
    def serves(self, handle: SyncHandle, node: str) -> bool:
        """Whether ``handle`` carries data an engine on ``node`` can read through this transport."""

    @abstractmethod
    def buckets(self, handle: SyncHandle, held: int) -> Iterator[Dict[str, torch.Tensor]]:
        """The buckets an engine holding sync ``held`` loads to hold ``handle.version``."""


class _Collected(WriteStream):
    """The default stream: the whole export collected, then one ``write``."""

    def __init__(self, writer: TransportWriter, handle: SyncHandle, request: SyncRequest):
        self.writer, self.handle, self.request = writer, handle, request
        self.sd: Dict[str, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.sd[name] = tensor

    def close(self) -> None:
        self.writer.write(self.sd, self.handle, self.request)
        self.sd = {}

    def abort(self) -> None:
        self.sd = {}


def write_all(stream: Optional[WriteStream], sd: Dict[str, torch.Tensor]) -> None:
    """Feed a whole dict through ``stream`` (a streaming writer's ``write``)."""
    if stream is None:
        return
    try:
        for name, tensor in sd.items():
            stream.add(name, tensor)
    except BaseException:
        stream.abort()
        raise
    stream.close()
