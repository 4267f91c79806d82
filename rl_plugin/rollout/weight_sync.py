"""Moving the trainer's weights into the rollout engines in buckets, and the transports that carry them.

Train rank 0 holds the exported Hugging Face state dict (each TP shard gathered once by the
backend's export). ``plan_buckets`` cuts it into buckets of at most ``--update-weight-buffer-size``
bytes, in export order, keeping a fused group whole: vLLM and SGLang fuse q/k/v and gate/up of a
layer into one parameter and repack it only once all its parts arrived (a group larger than the
buffer gets a bucket of its own). The engines load bucket after bucket in place, so neither side
ever needs a second full copy in flight beyond the buckets already sent.

Transports (``WeightTransport``): how a bucket gets from train rank 0 to every engine.
- ``ObjectStoreTransport`` (CPU, and GPU without a broadcast group): each bucket is put once in
  Ray's object store (shared memory on a node) by rank 0; every engine reads it from there.
- ``NcclBroadcastTransport`` (GPU): a NCCL group between train rank 0 and the engines' workers,
  one broadcast per bucket (slime / verl style). Not implemented in this build: asking for it
  fails loud (see its docstring).
"""

from __future__ import annotations

import abc
from typing import Dict, Iterator, List, Sequence

import torch

# Hugging Face leaf modules that inference engines fuse with their siblings of the same parent.
FUSED_GROUPS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def fused_group(name: str) -> str:
    """The key of the group a tensor must travel with: ``model.layers.3.self_attn.qkv_proj`` for
    ``model.layers.3.self_attn.k_proj.bias``; the tensor's own name when it is not fused."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[-2] in FUSED_GROUPS:
        return ".".join(parts[:-2] + [FUSED_GROUPS[parts[-2]]])
    return name


def plan_buckets(sizes: Dict[str, int], buffer_bytes: int) -> List[List[str]]:
    """Names in export order cut into buckets of at most ``buffer_bytes`` (a fused group whole;
    a group over the budget alone in its bucket). ``sizes``: bytes per tensor, in export order."""
    if buffer_bytes < 1:
        raise ValueError(f"--update-weight-buffer-size must be >= 1 byte (got {buffer_bytes})")
    groups: Dict[str, List[str]] = {}
    for name in sizes:
        groups.setdefault(fused_group(name), []).append(name)
    buckets: List[List[str]] = []
    current: List[str] = []
    used = 0
    for names in groups.values():
        nbytes = sum(sizes[n] for n in names)
        if current and used + nbytes > buffer_bytes:
            buckets.append(current)
            current, used = [], 0
        current.extend(names)
        used += nbytes
    if current:
        buckets.append(current)
    return buckets


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def iter_buckets(state_dict: Dict[str, torch.Tensor], buffer_bytes: int) -> Iterator[Dict[str, torch.Tensor]]:
    """The buckets of ``plan_buckets`` as dicts of CPU tensors."""
    plan = plan_buckets({k: tensor_bytes(v) for k, v in state_dict.items()}, buffer_bytes)
    for names in plan:
        yield {n: state_dict[n].detach().to("cpu").contiguous() for n in names}


class WeightTransport(abc.ABC):
    """Carries buckets from train rank 0 (``send``) to every engine (``receive``)."""

    @abc.abstractmethod
    def send(self, buckets: Iterator[Dict[str, torch.Tensor]]) -> List[object]:
        """Called on train rank 0: publish the buckets; returns small handles for the engines."""

    @abc.abstractmethod
    def receive(self, handles: Sequence[object]) -> Iterator[Dict[str, torch.Tensor]]:
        """Called in an engine process: the buckets, one at a time, in order."""


class ObjectStoreTransport(WeightTransport):
    """Each bucket ``ray.put`` once by rank 0 (owned by rank 0's actor); engines ``ray.get`` it,
    zero-copy from shared memory on the same node."""

    def send(self, buckets):
        import ray

        return [ray.put(b) for b in buckets]

    def receive(self, handles):
        import ray

        for ref in handles:
            yield ray.get(ref)


class NcclBroadcastTransport(WeightTransport):
    """GPU path: one NCCL broadcast per bucket from train rank 0 to the engines' workers (vLLM's
    ``StatelessProcessGroup`` + ``PyNcclCommunicator`` on the engine side, SGLang's
    ``/init_weights_update_group`` + ``/update_weights_from_distributed``). Not implemented in
    this build: it needs a GPU run to write and test; the object store carries the buckets
    meanwhile."""

    def __init__(self):
        if not torch.cuda.is_available():
            raise RuntimeError("the NCCL weight broadcast needs CUDA GPUs on the trainer and the rollout engines; on CPU the "
                               "object store carries the weights (the default)")
        raise NotImplementedError("the NCCL weight broadcast between train rank 0 and the rollout engines is not implemented yet; "
                                  "weights go through Ray's object store (ObjectStoreTransport)")

    def send(self, buckets):  # pragma: no cover - unreachable until implemented
        raise NotImplementedError

    def receive(self, handles):  # pragma: no cover
        raise NotImplementedError


def make_transport(name: str = "object_store") -> WeightTransport:
    if name == "object_store":
        return ObjectStoreTransport()
    if name == "nccl":
        return NcclBroadcastTransport()
    raise ValueError(f"unknown weight transport {name!r}; choose object_store or nccl")
