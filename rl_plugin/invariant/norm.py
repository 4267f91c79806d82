"""Batch-invariant RMSNorm (HF Llama / Qwen2 / Qwen3 / Mistral ``RMSNorm``, fp32 math).

    y = weight * (x * rsqrt(mean(x^2, -1) + eps))          (x in fp32, cast back before * weight)

The only reduction is ``mean`` over the last dim (hidden or head size), one contiguous row at a
time: ATen reduces a contiguous last dim row by row and splits a row across threads only when it
alone exceeds ``at::internal::GRAIN_SIZE`` (32768) elements, so ``rms_norm`` refuses rows that
long and a row's bits never depend on the number of rows, its offset or 1 vs 2 threads.
"""

from __future__ import annotations

import torch

MAX_ROW = 32768  # at::internal::GRAIN_SIZE: longer rows could be split across threads


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [..., H]`` with ``weight [H]`` (the formula of the module docstring, the same
    op order as transformers' ``LlamaRMSNorm``)."""
    if x.shape[-1] > MAX_ROW:
        raise ValueError(f"rms_norm: rows of {x.shape[-1]} > {MAX_ROW} elements may be reduced by several threads")
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)
