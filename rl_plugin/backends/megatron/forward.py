"""One micro-batch through the megatron-core GPTModel: inputs in, response-token logits out.

``response_logits(model, mb, ...)`` returns ``[n_local, V/tp]``: for every CP-local response token
of the micro-batch (``mb.layout.logit_index``), the row of this TP rank's vocab shard that
predicts it. Only those rows are kept, so the loss never touches prompt positions.

Input layouts (from ``rl_plugin.cp``, already CP-local):

- ``thd``: samples packed into one row ``[1, sum local_len]``, with ``PackedSeqParams``
  (``cu_seqlens`` = the samples' padded global boundaries, what TE's thd/CP attention takes and
  what RoPE uses to restart positions per sample).
- ``bshd``: ``[S, local_seq_len]`` padded rows, causal mask (padding sits after real tokens, so
  no real token attends to it).

``--fp32-lm-head``: the model runs with its post-process turned off (final hidden states, after
the final norm), and the output projection is ``fp32_output_projection`` on the response rows
only: fp32 accumulation and fp32 logits; its weight gradient reaches the original (bf16)
``output_layer.weight`` (its fp32 ``main_grad`` under DDP).
"""

from __future__ import annotations

import contextlib

import torch

from rl_plugin.loss import fp32_output_projection
from rl_plugin.loss.step import MicroBatch


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def model_inputs(mb: MicroBatch, qkv_format: str):
    """``(input_ids, position_ids, packed_seq_params)`` of a micro-batch for GPTModel.forward."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if qkv_format == "bshd":
        return mb.input_ids, mb.position_ids, None
    cu = mb.layout.cu_seqlens_padded
    max_len = int(mb.layout.padded_lengths.max()) if mb.layout.num_samples else 0
    psp = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
        max_seqlen_q=max_len, max_seqlen_kv=max_len,
    )
    return mb.input_ids.view(1, -1), mb.position_ids.view(1, -1), psp


@contextlib.contextmanager
def hidden_states_only(gpt):
    """GPTModel.forward returns the final (normed) hidden states ``[s, b, h]`` inside this block
    (megatron-core 0.16.1 ``GPTModel._postprocess``: ``if not self.post_process: return
    hidden_states``; the final norm belongs to the decoder, built with post_process=True)."""
    saved = gpt.post_process
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = saved


def response_logits(model, mb: MicroBatch, *, qkv_format: str, fp32_lm_head: bool) -> torch.Tensor:
    input_ids, position_ids, psp = model_inputs(mb, qkv_format)
    device = next(model.parameters()).device
    input_ids, position_ids = input_ids.to(device), position_ids.to(device)
    index = mb.layout.logit_index.to(device)
    if not fp32_lm_head:
        logits = model(input_ids, position_ids, None, packed_seq_params=psp)  # [b, s, V/tp]
        return logits.reshape(-1, logits.shape[-1])[index]
    from megatron.core import tensor_parallel

    gpt = unwrap(model)
    with hidden_states_only(gpt):
        hidden = model(input_ids, position_ids, None, packed_seq_params=psp)  # [s, b, h]
    if gpt.config.sequence_parallel:
        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden)
    rows = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])[index]
    # The TP ranks hold the same hidden rows and different vocab shards: identity forward,
    # all-reduce of d(rows) backward (what ColumnParallelLinear does for its input).
    rows = tensor_parallel.copy_to_tensor_model_parallel_region(rows)
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else gpt.output_layer.weight
    return fp32_output_projection(rows, weight)
