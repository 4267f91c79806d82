"""Batch- and position-invariant ops for true on-policy training (issue 45, ``--true-on-policy-mode``).

A row's (token's) result depends only on its own inputs (for attention: its document's keys up to
it), never on the row count, packing, decode vs full sequence or 1 vs 2 threads. Each module's
docstring states its fixed tiling. The final signatures:

- ``linear(x[..., K], weight[N, K], bias=None) -> [..., N]``; row-parallel TP:
  ``linear_partials(x, weight, parts=K_PARTS // tp) -> [parts, ..., N]`` per rank, all-gathered
  in rank order along dim 0, then ``combine_partials(partials, bias)``.        (``linear``)
- ``rms_norm(x, weight, eps)``                                                  (``norm``)
- ``rope_cos_sin(positions, inv_freq, attention_scaling=1.0) -> (cos, sin)``,
  ``apply_rope(x, cos, sin)`` (rotate-half)                                     (``rope``)
- ``log_softmax(logits[rows, V], temperature) -> [rows, V]``,
  ``token_log_probs(logits, targets, temperature) -> [rows]``; vocab-parallel:
  ``log_softmax_partials(logits / T) -> (m, s) [rows, blocks]`` per shard (shards start at a
  multiple of ``VOCAB_BLOCK``), gathered in vocab order, ``log_softmax_combine(m, s) -> lse``.
- ``attention(q[N, Hq, d], k[M, Hkv, d], v, key_start[N], q_pos[N], scale) -> [N, Hq, d]``;
  ``packed_positions(cu_seqlens, total)``, ``decode_attention(q, k_cache, v_cache, lengths, scale)``.
- ``hf_patch.make_invariant(model)``: an HF Llama / Qwen2 / Qwen3 / Mistral model onto these ops.
"""

from rl_plugin.invariant.attention import attention, decode_attention, packed_positions
from rl_plugin.invariant.linear import K_PARTS, ROW_TILE, combine_partials, linear, linear_partials
from rl_plugin.invariant.log_softmax import (
    VOCAB_BLOCK,
    log_softmax,
    log_softmax_combine,
    log_softmax_partials,
    scale_logits,
    token_log_probs,
)
from rl_plugin.invariant.norm import rms_norm
from rl_plugin.invariant.rope import apply_rope, rope_cos_sin

__all__ = [
    "K_PARTS",
    "ROW_TILE",
    "VOCAB_BLOCK",
    "apply_rope",
    "attention",
    "combine_partials",
    "decode_attention",
    "linear",
    "linear_partials",
    "log_softmax",
    "log_softmax_combine",
    "log_softmax_partials",
    "packed_positions",
    "rms_norm",
    "rope_cos_sin",
    "scale_logits",
    "token_log_probs",
]
