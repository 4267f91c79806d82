"""``--offload-train``: the training state moves to host memory while colocated engines generate.

Colocated (``--colocate``), the rollout engines and the training ranks time-share one device. While
the engines generate, a train rank's parameters, gradients (``.grad`` and Megatron's ``main_grad``
buffers), optimizer state (Adam's moments, the fp32 main copies of the Megatron optimizers) and
its reference model are copied to host buffers and their device memory is freed; the train call
that follows copies them back before its first forward (slime's ``--offload-train``, verl's param
/ optimizer offload). Both backends share this module: a backend names its state
(``TrainBackend.state_tensors``) and ``HostOffload`` moves it.

How, per storage (not per tensor): tensors that share memory (Megatron's params and ``main_grad``
are views into the DDP buffers; FSDP2's shards are views of their flat shard) are grouped by their
``untyped_storage()``. Each storage's bytes are copied into a host buffer of their own (pinned on
GPUs, so the copies run at full PCIe speed) and the storage is shrunk to 0 bytes
(``untyped_storage().resize_(0)``): every view keeps its shape, stride and offset but owns no
memory, and the caching allocator gets the memory back (``torch.cuda.empty_cache`` returns it to
the driver, where vLLM's allocator can take it). ``reload`` grows each storage back to its size
and copies the bytes in: the very storage objects every view, optimizer and hook points at, so
nothing is re-registered and the state comes back bitwise (bytes, not values: ``-0.0`` and NaN
payloads included). On a CPU the "device" is host memory already: the copy and the free still run
(so the tests prove the round trip), they just save nothing.

Not offloaded: storages of 0 bytes (FSDP2's resharded unsharded params), storages that cannot be
resized (a memory-mapped checkpoint tensor, shared memory; counted in ``skipped``), and anything
not on the backend's device.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, List, Optional, Tuple

import torch


def module_tensors(module: Any) -> Iterator[torch.Tensor]:
    """A model's (or a list of model chunks') parameters, gradients, ``main_grad`` and buffers, and
    Megatron DDP's flat param / grad buffers (its ``buffers`` attribute, which shadows the method)."""
    if module is None:
        return
    for m in module if isinstance(module, (list, tuple)) else [module]:
        for p in m.parameters():
            yield p
            for grad in (p.grad, getattr(p, "main_grad", None)):
                if isinstance(grad, torch.Tensor):
                    yield grad
        yield from torch.nn.Module.buffers(m)
        for attr in ("buffers", "expert_parallel_buffers"):
            flat = getattr(m, attr, None)
            for buf in flat if isinstance(flat, list) else ():
                for data in (getattr(buf, "param_data", None), getattr(buf, "grad_data", None)):
                    if isinstance(data, torch.Tensor):
                        yield data


def optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Every tensor of an optimizer's state and parameter groups (the fp32 main params of the
    Megatron optimizers are the groups' params), through Megatron's wrappers (``.optimizer``) and
    chains (``.chained_optimizers``)."""
    if optimizer is None:
        return
    if isinstance(optimizer, torch.optim.Optimizer):
        for group in optimizer.param_groups:
            yield from group["params"]
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        return
    for inner in getattr(optimizer, "chained_optimizers", None) or []:
        yield from optimizer_tensors(inner)
    yield from optimizer_tensors(getattr(optimizer, "optimizer", None))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2) local shard; any other tensor as it is."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _bytes_of(storage) -> torch.Tensor:
    """A flat uint8 tensor over the whole of ``storage`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostOffload:
    """The training state of one rank, in host memory or on its device (``offloaded``)."""

    def __init__(self):
        self._held: List[Tuple[Any, torch.Tensor]] = []  # (the emptied storage, its bytes on the host)
        # the host buffers, kept for the next offload: pinned memory is slow to allocate (the same
        # storages, in the same order, every rollout); they hold the state's size in host memory
        self._buffers: List[torch.Tensor] = []
        self.offloaded = False
        self.bytes = 0  # moved by the last offload
        self.skipped = 0  # storages left in place (not resizable)

    def offload(self, tensors: Iterable[torch.Tensor], device: torch.device) -> int:
        """Copy the storages of ``tensors`` that live on ``device`` to the host and free them;
        returns the bytes moved. A second call before ``reload`` does nothing."""
        if self.offloaded:
            return 0
        seen, self.bytes, self.skipped = set(), 0, 0
        for t in tensors:
            t = _local(t)
            if t.device.type != device.type:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            if not storage.resizable():
                self.skipped += 1
                continue
            k = len(self._held)
            if k < len(self._buffers) and self._buffers[k].numel() == storage.nbytes():
                host = self._buffers[k]
            else:
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=device.type == "cuda")
                self._buffers[k:] = [host]
            host.copy_(_bytes_of(storage), non_blocking=device.type == "cuda")
            self._held.append((storage, host))
            self.bytes += storage.nbytes()
        if device.type == "cuda":
            torch.cuda.synchronize()  # every copy landed before its source is freed
        for storage, _ in self._held:
            storage.resize_(0)  # the views stay; their memory goes back to the allocator
        if device.type == "cuda":
            torch.cuda.empty_cache()  # and from the allocator to the driver (the engines' wake)
        self.offloaded = True
        return self.bytes

    def reload(self) -> Optional[int]:
        """Grow every storage back and copy its bytes in (bitwise); None when nothing was offloaded."""
        if not self.offloaded:
            return None
        for storage, host in self._held:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host, non_blocking=True)
        if self._held and self._held[0][0].device.type == "cuda":
            torch.cuda.synchronize()  # the host buffers are dropped next
        moved, self._held, self.offloaded = self.bytes, [], False
        return moved
