"""Model inputs of one micro-batch for a Hugging Face model, and logits -> response rows.

**thd (packed).** The micro-batch's samples are concatenated into one row ``[1, sum T_i]`` with
per-sample position ids. HF's sdpa/eager attention does not isolate packed samples by position
ids under every configuration (a KV cache, or a 2-D mask, disables transformers' packed-sequence
detection), so we pass an explicit 4-D block-diagonal causal mask ``[1, 1, T, T]``: token i may
attend to token j iff both belong to the same sample and j <= i. transformers hands a 4-D mask to
the attention function as-is, so its format follows the implementation: bool (True = attend) for
sdpa, additive float (0 / finfo.min) for eager. flash-attention implementations get no mask:
they split packed samples by the position-id resets (varlen kernels), and the T x T mask would
be the memory cost they avoid.

**bshd (padded).** ``[S, L]`` rows padded to the micro-batch's padded length, with the usual 2-D
padding mask; padding never sits before a real token, so causal attention of real tokens never
sees it.

``micro_batch_logits`` returns the logits rows ``[n_local, V]`` that predict the micro-batch's
response tokens, in ``layout.logit_index`` order: exactly the ``rows`` the loss core expects. For
thd only those rows are projected (``logits_to_keep`` = the index), so no ``[T, V]`` logits of
prompt tokens are built.

``micro_batch_log_probs`` returns ``(logp, entropy)`` of those rows: with a ``FusedLogProbHead``
installed the model's forward returns them directly (the head gets the response rows' hidden
states and never builds their logits); otherwise from ``micro_batch_logits``.
"""

from __future__ import annotations

import torch

from rl_plugin.backends.attention_mask import block_causal_mask
from rl_plugin.loss import log_probs_and_entropy

FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")


def packed_causal_mask(cu_seqlens: torch.Tensor, attn_implementation: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Block-diagonal causal mask ``[1, 1, T, T]`` of samples with boundaries ``cu_seqlens``
    (``rl_plugin.backends.attention_mask``), in the format ``attn_implementation`` takes."""
    total = int(cu_seqlens[-1])
    allowed = block_causal_mask(cu_seqlens, total).view(1, 1, total, total)
    if attn_implementation == "eager":
        zeros = torch.zeros((), dtype=dtype)
        return torch.where(allowed, zeros, torch.tensor(torch.finfo(dtype).min, dtype=dtype))
    return allowed


def model_inputs(mb, attn_implementation: str, device: torch.device) -> dict:
    """Keyword arguments of the HF model's forward for one ``rl_plugin.loss.MicroBatch``."""
    layout = mb.layout
    if layout.qkv_format == "thd":
        kwargs = dict(input_ids=mb.input_ids.view(1, -1), position_ids=mb.position_ids.view(1, -1))
        if attn_implementation not in FLASH_IMPLEMENTATIONS:
            kwargs["attention_mask"] = packed_causal_mask(layout.local_cu_seqlens, attn_implementation)
        kwargs["logits_to_keep"] = layout.logit_index.to(device)
    else:
        kwargs = dict(
            input_ids=mb.input_ids, position_ids=mb.position_ids,
            attention_mask=(layout.input_index >= 0).view(layout.num_samples, -1).long(),
        )
    kwargs = {k: v.to(device) for k, v in kwargs.items()}
    kwargs["use_cache"] = False
    return kwargs


def micro_batch_logits(model, mb, attn_implementation: str, device: torch.device) -> torch.Tensor:
    """Logits rows ``[n_local, V]`` aligned with ``mb.targets`` (see module docstring)."""
    logits = model(**model_inputs(mb, attn_implementation, device)).logits
    if mb.layout.qkv_format == "thd":
        return logits.view(-1, logits.shape[-1])  # already only the kept rows, in index order
    return logits.reshape(-1, logits.shape[-1])[mb.layout.logit_index.to(logits.device)]



def micro_batch_log_probs(model, mb, attn_implementation: str, device: torch.device, *, temperature: float,
                          chunk_size: int, with_entropy: bool):
    """``(logp, entropy)`` ``[n_local]`` aligned with ``mb.targets`` (see module docstring)."""
    from rl_plugin.backends.fsdp.model import FusedLogProbHead, FusedRequest

    targets = mb.targets.to(device)
    head = model.get_output_embeddings()
    if not isinstance(head, FusedLogProbHead):
        rows = micro_batch_logits(model, mb, attn_implementation, device)
        return log_probs_and_entropy(rows, targets, temperature=temperature, chunk_size=chunk_size,
                                     with_entropy=with_entropy)
    row_index = None if mb.layout.qkv_format == "thd" else mb.layout.logit_index.to(device)
    request = FusedRequest(targets=targets, temperature=temperature, chunk_size=chunk_size,
                           with_entropy=with_entropy, row_index=row_index)
    with head.fused(request):
        out = model(**model_inputs(mb, attn_implementation, device)).logits  # [1, n, 2]
    logp, ent = out.view(-1, 2).unbind(1)
    return logp, ent
