"""The tiny mixture-of-experts configs (``rl_plugin.models.tiny_moe``): the released models' router
scoring per family (renormalised top-k or not, the shared expert), the sizes vLLM's CPU attention
takes, and the refusals."""

from __future__ import annotations

import pytest

from rl_plugin.models.tiny import tiny_config
from rl_plugin.models.tiny_moe import MOE_FAMILIES, MOE_SIZES


def _cfg(family, **kw):
    return tiny_config(family, **{**MOE_SIZES, **kw})


def test_each_family_scores_as_released():
    q3, q2, mx = (_cfg(f) for f in MOE_FAMILIES)
    assert (q3.num_experts, q3.num_experts_per_tok, q3.norm_topk_prob, q3.decoder_sparse_step) == (4, 2, True, 1)
    assert (q2.norm_topk_prob, q2.shared_expert_intermediate_size, q2.qkv_bias) == (False, 64, True)
    assert (mx.num_local_experts, mx.num_experts_per_tok, mx.intermediate_size) == (4, 2, 32)
    assert q3.hidden_size // q3.num_attention_heads == 32 and q3.mlp_only_layers == []
    assert _cfg("qwen2_moe", norm_topk_prob=True).norm_topk_prob is True
    assert _cfg("qwen3_moe", num_experts=8, top_k=3).num_experts_per_tok == 3


def test_refusals():
    with pytest.raises(ValueError, match="mixtral has no norm_topk_prob"):
        _cfg("mixtral", norm_topk_prob=False)
    with pytest.raises(ValueError, match=r"qwen3_moe: head_dim 16 must equal hidden_size 128 / num_heads 4"):
        _cfg("qwen3_moe", head_dim=16)
    assert _cfg("mixtral", head_dim=16).head_dim == 16  # Mixtral carries its own head_dim
