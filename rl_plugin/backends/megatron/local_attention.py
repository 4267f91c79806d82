"""Packed (``thd``) attention for the local layer spec, where transformer-engine is absent.

megatron-core's local ``DotProductAttention`` asserts ``packed_seq_params is None``; TE's
attention is the only thd kernel. ``VarlenDotProductAttention`` keeps the local kernel and adds
the thd case: the packed stream ``[t, heads, dim]`` is attended as one batch row with a
block-diagonal causal mask built from ``cu_seqlens_q_padded`` (or ``cu_seqlens_q``), i.e. token
``a`` sees token ``b`` iff both lie in the same sample and ``b <= a``. RoPE positions restart per
sample already upstream (``apply_rotary_pos_emb(..., cu_seqlens=...)`` in megatron-core's
attention), so this equals running each sample alone. O(t^2) memory: a CPU / test path; GPU runs
use TE's varlen kernels. No context parallelism here (CP needs TE, checked at start-up).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


def block_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[1, 1, t, t]`` bool, True where attention is NOT allowed (megatron's mask convention)."""
    pos = torch.arange(total, device=cu_seqlens.device)
    seg = torch.bucketize(pos, cu_seqlens[1:].to(pos.dtype), right=True)
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    return (~allowed).view(1, 1, total, total)


class VarlenDotProductAttention(DotProductAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        t = query.shape[0]
        mask = block_causal_mask(cu, t)
        # [t, n, d] -> [t, b=1, n, d]; the parent returns [t, 1, n*d], the caller wants [t, n*d].
        out = super().forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask,
                              attn_mask_type=attn_mask_type, attention_bias=attention_bias, packed_seq_params=None)
        return out.reshape(t, -1)
