"""Packed (``thd``) attention for the local layer spec, where transformer-engine is absent.

megatron-core's local ``DotProductAttention`` asserts ``packed_seq_params is None``; TE's
attention is the only thd kernel. ``VarlenDotProductAttention`` keeps the local kernel and adds
the thd case: the packed stream ``[t, heads, dim]`` is attended as one batch row with the
block-diagonal causal mask of ``cu_seqlens_q_padded`` (or ``cu_seqlens_q``),
``rl_plugin.backends.attention_mask.block_causal_mask``: token ``a`` sees token ``b`` iff both
lie in the same sample and ``b <= a``. RoPE positions restart per
sample already upstream (``apply_rotary_pos_emb(..., cu_seqlens=...)`` in megatron-core's
attention), so this equals running each sample alone. O(t^2) memory: a CPU / test path; GPU runs
use TE's varlen kernels. No context parallelism here (CP needs TE, checked at start-up).
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention

from rl_plugin.backends.attention_mask import block_causal_mask


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
        mask = (~block_causal_mask(cu, t)).view(1, 1, t, t)  # megatron's convention: True = masked out
        # [t, n, d] -> [t, b=1, n, d]; the parent returns [t, 1, n*d], the caller wants [t, n*d].
        out = super().forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), mask,
                              attn_mask_type=attn_mask_type, attention_bias=attention_bias, packed_seq_params=None)
        return out.reshape(t, -1)
