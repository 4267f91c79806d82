"""The block-diagonal causal mask of packed samples, for attention kernels without a varlen path.

Samples packed into one row (thd) with boundaries ``cu_seqlens`` must not see each other: token
``a`` may attend to token ``b`` iff both lie in the same sample and ``b <= a``. Running the
packed row with this mask equals running each sample alone (positions restart per sample
upstream). Both backends build it here: Megatron's local attention (``megatron/compat/local_attention.py``,
which wants True where attention is NOT allowed) and FSDP's HF model (``fsdp/packing.py``: bool
for sdpa, additive 0 / finfo.min for eager). ``[T, T]`` memory: a CPU / test path; GPU runs use
varlen kernels that take ``cu_seqlens`` directly and never build it.
"""

from __future__ import annotations

import torch

from rl_plugin.cp import segment_ids


def block_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[total, total]`` bool, True where both tokens lie in the same packed sample (no causality:
    the vision tower's bidirectional windows), on ``cu_seqlens``' device. ``total`` (the packed
    row's length) must equal ``cu_seqlens[-1]``."""
    seg = segment_ids(cu_seqlens[1:] - cu_seqlens[:-1])
    if seg.numel() != total:
        raise ValueError(f"block mask: the packed row has {total} tokens but cu_seqlens covers {seg.numel()}")
    return seg[:, None] == seg[None, :]


def block_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[total, total]`` bool, True where attention IS allowed, on ``cu_seqlens``' device:
    ``block_mask`` and ``b <= a``."""
    pos = torch.arange(total, device=cu_seqlens.device)
    return block_mask(cu_seqlens, total) & (pos[None, :] <= pos[:, None])
