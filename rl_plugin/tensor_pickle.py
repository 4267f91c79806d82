"""Pickling a group of small CPU tensors as one buffer: how rollouts, step batches and step plans
travel between the driver and the Ray actors (``RolloutData``, ``StepBatch``, ``RankPlan``).

torch pickles every tensor through its storage machinery (a storage object and ``torch.save``'s
persistent ids per tensor): ~40-90 us per tensor each way, ~0.7 ms for a rollout's six tensors.
numpy arrays travel as pickle-5 out-of-band buffers, which Ray handles one by one. Here the
tensors of one object travel as ONE in-band ``bytearray`` (each tensor's bytes at an offset
aligned to ``ALIGN``) plus ``(dtype, shape, offset)`` per tensor; loading makes every tensor a
view of the loaded buffer, writable, without a further copy. A Ray actor call carrying an
embedded rollout's six tensors (~16 KB; ``benchmarks/transport_pickle.py``, 2 shared cores):
torch ~1.7-2.4 ms, numpy ~1.0-1.7 ms, this ~0.8-1.1 ms, a no-op call ~0.6-0.8 ms.

Exact: the bytes copied are the tensors' memory (only the viewed elements of a view), dtypes
(bf16 included), shapes and None entries are kept. A tensor that needs torch's own pickling
(off the CPU, requiring grad, not strided: sparse, quantised) makes ``pack_tensors`` return
None and the caller keeps torch's pickling for the whole object.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

ALIGN = 64  # every tensor's offset in the buffer is a multiple of this (a cache line), so of its element size

_PAD = bytes(ALIGN)
# dtypes whose tensors ``Tensor.numpy()`` returns as is (the others travel as their bytes)
NUMPY_DTYPES = frozenset(
    (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    + (torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128)
)
_NAMES = {d: str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)}
# (buffer, one (dtype name, shape, byte offset) or None per tensor)
Packed = Tuple[bytearray, Tuple[Optional[Tuple[str, Tuple[int, ...], int]], ...]]


def packable(t: Optional[torch.Tensor]) -> bool:
    """True when ``t`` (or None) travels in the buffer: a strided CPU tensor not requiring grad."""
    return t is None or (t.is_cpu and not t.requires_grad and t.layout == torch.strided)


def _array(t: torch.Tensor) -> np.ndarray:
    """The tensor's elements as a numpy array of the same bytes (bf16 and other dtypes numpy
    lacks: as unsigned bytes)."""
    if t.dtype in NUMPY_DTYPES:
        try:
            return t.numpy()
        except RuntimeError:  # a lazy conjugate / negative view: materialise it
            return t.resolve_conj().resolve_neg().numpy()
    return t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy()


def pack_tensors(tensors: Sequence[Optional[torch.Tensor]]) -> Optional[Packed]:
    """``tensors`` (None entries allowed) as one picklable buffer and their layout; None when one
    of them cannot travel this way (``packable``)."""
    if not all(packable(t) for t in tensors):
        return None
    buffer = bytearray()
    layout = []
    for t in tensors:
        if t is None:
            layout.append(None)
            continue
        buffer += _PAD[: -len(buffer) % ALIGN]
        layout.append((_NAMES[t.dtype], tuple(t.shape), len(buffer)))
        buffer += _array(t).tobytes()  # C order: a strided view travels as its elements only
    return buffer, tuple(layout)


def unpack_tensors(packed: Packed) -> List[Optional[torch.Tensor]]:
    """Inverse of ``pack_tensors``: every tensor a view of the buffer (shared, writable)."""
    buffer, layout = packed
    out: List[Optional[torch.Tensor]] = []
    for entry in layout:
        if entry is None:
            out.append(None)
            continue
        name, shape, offset = entry
        dtype = getattr(torch, name)
        count = math.prod(shape)
        if count == 0:
            out.append(torch.empty(shape, dtype=dtype))
        else:
            out.append(torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).view(shape))
    return out


def reduce_dataclass(obj) -> Optional[Tuple[Any, tuple]]:
    """``__reduce_ex__``'s answer for a dataclass whose class names its tensor fields in
    ``TENSOR_FIELDS``: those travel in one buffer (``pack_tensors``), every other field pickles as
    it is (a field added later travels without a change here); None when a tensor needs torch's
    pickling (the caller then keeps the default)."""
    names = type(obj).TENSOR_FIELDS
    packed = pack_tensors([getattr(obj, name) for name in names])
    if packed is None:
        return None
    others = {f.name: getattr(obj, f.name) for f in fields(obj) if f.name not in names}
    return _dataclass_from_packed, (type(obj), packed, others)


def _dataclass_from_packed(cls, packed: Packed, others: Dict[str, Any]):
    """Inverse of ``reduce_dataclass``: the tensors are views of one writable buffer."""
    return cls(**dict(zip(cls.TENSOR_FIELDS, unpack_tensors(packed))), **others)
