"""rl_plugin.invariant.rope: cos/sin of a position do not depend on the other positions in the call
(offset, count, threads), and equal transformers' Llama rotary embedding."""

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from rl_plugin.invariant.rope import apply_rope, rope_cos_sin


def _rotary():
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=10000.0, max_position_embeddings=4096)
    return LlamaRotaryEmbedding(cfg)


def test_a_position_alone_equals_it_among_others(threads):
    inv_freq = _rotary().inv_freq
    positions = torch.arange(3000)
    cos, sin = rope_cos_sin(positions, inv_freq)
    for start, count in ((0, 1), (17, 1), (2999, 1), (5, 64), (1000, 333)):
        c, s = rope_cos_sin(positions[start : start + count], inv_freq)
        assert torch.equal(c, cos[start : start + count]) and torch.equal(s, sin[start : start + count])


def test_equals_transformers_rope():
    rotary = _rotary()
    positions = torch.arange(50)[None]
    x = torch.randn(1, 50, 16)
    ref_cos, ref_sin = rotary(x, positions)
    cos, sin = rope_cos_sin(positions, rotary.inv_freq, rotary.attention_scaling)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-6)
    q, k = torch.randn(1, 4, 50, 16), torch.randn(1, 2, 50, 16)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
    torch.testing.assert_close(apply_rope(q, cos[:, None], sin[:, None]), ref_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_rope(k, cos[:, None], sin[:, None]), ref_k, rtol=1e-6, atol=1e-6)
