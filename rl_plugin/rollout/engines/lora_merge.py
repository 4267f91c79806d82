"""An engine's adapters and the base it keeps: W = W_base + (alpha / r) B A, never accumulated.

With ``--lora-rank`` a weight sync carries adapter tensors only (canonical names,
``...q_proj.lora_A.weight`` / ``...lora_B.weight``). An engine that cannot hold adapters (the
``hf`` engine) keeps, for every targeted linear, a copy of its base weight taken when the first
adapter of that linear arrives (before anything but adapters ever reached it: the checkpoint's
weight) and the newest A and B it received. After each bucket every linear whose A or B changed
is rewritten from the kept base: ``W = W_base + scaling * (B @ A)`` in fp32, cast to the
weight's dtype. The merged weight depends on the kept base and the latest adapters only, so
rounding never builds up across syncs and a bucket holding only A or only B of a linear is fine
(B missing = zeros).
"""

from __future__ import annotations

from typing import Dict, Iterable, Set, Tuple

import torch

SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter(name: str) -> bool:
    return name.endswith(SUFFIXES)


def split_bucket(bucket: Dict[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """(adapter tensors, every other tensor) of a sync bucket."""
    adapters = {k: v for k, v in bucket.items() if is_adapter(k)}
    return adapters, {k: v for k, v in bucket.items() if k not in adapters}


def module_of(name: str) -> str:
    """``model.layers.0.self_attn.q_proj`` of ``model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return name.rsplit(".", 2)[0]


class KeptBaseMerge:
    """The adapters an engine received and the base weights it merges them into (module docstring)."""

    def __init__(self, scaling: float):
        self.scaling = float(scaling)
        self.adapters: Dict[str, torch.Tensor] = {}  # canonical name -> fp32 CPU copy
        self.base: Dict[str, torch.Tensor] = {}  # module path -> its base weight (kept copy)

    def receive(self, adapters: Dict[str, torch.Tensor]) -> Set[str]:
        """Keep copies of ``adapters``; returns the module paths they touch."""
        for name, value in adapters.items():
            self.adapters[name] = value.detach().to("cpu", torch.float32, copy=True)
        return {module_of(n) for n in adapters}

    def delta(self, module: str, shape) -> torch.Tensor:
        """``scaling * B @ A`` of one module (zeros until both arrived)."""
        a, b = self.adapters.get(f"{module}.lora_A.weight"), self.adapters.get(f"{module}.lora_B.weight")
        if a is None or b is None:
            return torch.zeros(shape, dtype=torch.float32)
        return self.scaling * (b @ a)

    @torch.no_grad()
    def apply(self, modules: Iterable[str], weight_of) -> None:
        """Rewrite each module's weight (``weight_of(module)``: the live parameter) from its kept base."""
        for module in sorted(modules):
            weight = weight_of(module)
            base = self.base.setdefault(module, weight.detach().to("cpu", copy=True))
            merged = base.float() + self.delta(module, tuple(base.shape))
            weight.copy_(merged.to(weight.dtype))
