"""Rotary position embeddings (HF's rotate-half convention), elementwise only.

    freqs = position * inv_freq           (one fp32 product per element: exact, no reduction)
    cos, sin = cos(cat(freqs, freqs)) * s, sin(cat(freqs, freqs)) * s     (s: attention_scaling)
    apply: x * cos + rotate_half(x) * sin,   rotate_half([a, b]) = [-b, a]

HF computes ``freqs`` as a matmul of ``inv_freq [d/2, 1]`` and ``positions [1, T]`` (K = 1: one
product each, the same value). Elementwise transcendental ops give the same bits for an element
at any offset and thread count on this CPU (checked by the tests), so a position's cos/sin do not
depend on the other positions in the call.
"""

from __future__ import annotations

from typing import Tuple

import torch


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[..., d]`` fp32 for integer ``positions [...]`` and ``inv_freq [d/2]``."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (``cos``/``sin`` broadcast against ``x [..., d]``)."""
    return x * cos + rotate_half(x) * sin
