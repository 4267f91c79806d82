"""Which tensors travel together, and in which buckets.

- A fused group (``FUSED_GROUPS``: q/k/v, gate/up of a layer; ``EXPERT``: all the experts of an
  MoE layer) always travels whole: vLLM repacks it into one parameter only once all its parts
  arrived. So does a layer's weight with its bias: vLLM's in-place reload processes a layer from
  the parameters one call gave it, and a layer given its weight alone got an uninitialised bias
  (measured: NaN in Qwen2.5-VL's vision ``attn.qkv`` after a sync that split the two).
- ``plan_buckets`` cuts the tensors to send, in export order, into buckets of at most
  ``--update-weight-buffer-size`` bytes, a fused group whole (a group over the budget alone in its
  bucket). The peak an engine holds for one load is one bucket.
- ``changed_bitwise`` decides whether a tensor changed since the last sync: bit for bit, a strided
  probe first (a trained tensor differs there almost surely; an unchanged one costs one read).
"""

from __future__ import annotations

import re
from typing import Dict, Iterator, List, Sequence

import torch

# Hugging Face leaf modules that inference engines fuse with their siblings of the same parent.
FUSED_GROUPS = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
PROBE_ELEMENTS = 4096  # strided elements compared first when looking for a change
BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# an MoE expert tensor (checkpoint names): every expert of a layer travels with the others, since
# inference engines hold a layer's experts in one fused parameter (vLLM: w13 / w2)
EXPERT = re.compile(r"^(.*\.experts)\.\d+\.\w+\.weight$")


def fused_group(name: str) -> str:
    """The key of the group a tensor must travel with: ``model.layers.3.self_attn.qkv_proj`` for
    ``model.layers.3.self_attn.k_proj.bias``, ``model.layers.3.mlp.experts`` for any expert of
    layer 3, a layer's weight name for its bias (``visual.blocks.0.attn.proj.weight`` for
    ``visual.blocks.0.attn.proj.bias``); the tensor's own name otherwise."""
    expert = EXPERT.match(name)
    if expert:
        return expert.group(1)
    parts = name.split(".")
    if len(parts) >= 3 and parts[-2] in FUSED_GROUPS:
        return ".".join(parts[:-2] + [FUSED_GROUPS[parts[-2]]])
    if parts[-1] == "bias":  # a layer's bias travels with its weight
        return ".".join(parts[:-1] + ["weight"])
    return name


def whole_groups(names: Sequence[str], all_names: Sequence[str]) -> List[str]:
    """``names`` widened to whole fused groups, in the order of ``all_names``."""
    groups = {fused_group(n) for n in names}
    return [n for n in all_names if fused_group(n) in groups]


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


def changed_bitwise(old: torch.Tensor, new: torch.Tensor) -> bool:
    """True unless ``new`` equals ``old`` bit for bit (-0.0 vs 0.0 and NaN payloads count). A
    strided probe of ``PROBE_ELEMENTS`` first: a trained tensor differs there almost surely."""
    bits = BITS_OF_SIZE[old.element_size()]  # the same-width integer type: equal ints = equal bits
    a, b = old.reshape(-1).view(bits), new.reshape(-1).view(bits)
    step = max(1, a.numel() // PROBE_ELEMENTS)
    if not torch.equal(a[::step], b[::step]):
        return True
    return not torch.equal(a, b)
