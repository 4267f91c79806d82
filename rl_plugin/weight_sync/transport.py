"""The transport interface: how one sync's tensors get from train rank 0 to an engine.

A transport has two halves. Its ``Writer`` lives in train rank 0's process: ``write`` puts the
tensors of sync ``handle.version`` somewhere the engines can read and records where in the handle.
Its ``Reader`` lives in an engine's process: ``serves`` says whether the handle carries data this
engine can read through it, ``buckets`` yields the buckets to load (at most
``handle.buffer_bytes`` each, a fused group whole). ``WeightPublisher`` and ``WeightReceiver``
compose them (``--update-weight-transport``); the implementations are ``shared_memory.py`` (same
node), ``object_store.py`` (any node) and ``distributed.py`` (a collective group; GPU).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Dict, Iterator

import torch

from rl_plugin.weight_sync.handle import SyncHandle, SyncRequest

# --update-weight-transport's choices: auto composes shared memory and the object store; nccl is
# the distributed transport's other name (what it uses on GPUs)
TRANSPORTS = ("auto", "shared_memory", "object_store", "distributed", "nccl")
DISTRIBUTED = ("distributed", "nccl")


class TransportWriter(ABC):
    """Train rank 0's half of a transport."""

    name: str = ""

    @abstractmethod
    def write(self, sd: Dict[str, torch.Tensor], handle: SyncHandle, request: SyncRequest) -> None:
        """Make ``sd`` (CPU, contiguous, tied names dropped) readable as sync ``handle.version``
        and record where in ``handle`` (adding the bytes it wrote to ``handle.sent_bytes``)."""

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
