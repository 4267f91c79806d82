"""The initial adapter weights, the same on every backend and every parallel layout.

A starts as PEFT starts it, ``kaiming_uniform_(a=sqrt(5))`` on an ``r x in`` matrix, i.e.
U(-b, b) with b = sqrt(6 / ((1 + 5) * in)) = 1 / sqrt(in); B starts at zero, so the first forward
is the base model's. Unlike PEFT (which draws from the global RNG in module order), the draw here
depends only on (seed, adapter name, shape): a torch.Generator seeded with
``seed * 1_000_003 + crc32(name)`` draws the full, unsharded A, and a tensor-parallel rank takes
its slice of that. So TP1 and TP2, Megatron and FSDP start from identical adapters.

Names are the canonical adapter names (``names.lora_a_name``), e.g.
``model.layers.0.self_attn.q_proj.lora_A.weight``.
"""

from __future__ import annotations

import math
import zlib

import torch


def adapter_seed(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def initial_lora_a(name: str, rank: int, in_features: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """A's full initial value, ``[rank, in_features]``, U(-1/sqrt(in), 1/sqrt(in)) drawn from the
    name's own generator (float32 draw, then cast)."""
    gen = torch.Generator().manual_seed(adapter_seed(seed, name))
    bound = 1.0 / math.sqrt(in_features)
    a = torch.rand(rank, in_features, generator=gen, dtype=torch.float32) * (2 * bound) - bound
    return a.to(dtype)


def initial_lora_b(rank: int, out_features: int, dtype=torch.float32) -> torch.Tensor:
    """B's initial value, ``[out_features, rank]`` zeros."""
    return torch.zeros(out_features, rank, dtype=dtype)
