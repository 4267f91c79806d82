"""Model inputs of one micro-batch for a Hugging Face model, and logits -> response rows.

**thd (packed).** The micro-batch's samples are concatenated into one stream of ``t = sum T_i``
tokens with per-sample position ids. HF's sdpa/eager attention does not isolate packed samples by
position ids under every configuration (a KV cache, or a 2-D mask, disables transformers'
packed-sequence detection), so the samples are isolated explicitly, in one of two equivalent ways:

- *padded grid* (when ``rl_plugin.cp.padded_attention_is_cheaper``: ``S * L^2 <= t^2``, L the
  longest sample; the usual case): the stream is laid out as a right-padded batch ``[S, L]``
  (``rl_plugin.cp.segment_grid``) with the 2-D padding mask, so attention costs ``S * L^2``
  scores instead of ``t^2``. Each real token attends to exactly the same keys as under the block
  mask (its own sample's tokens ``<= `` it; padding sits after every real token of its row), so
  per-token results equal the block-mask form up to the kernels' summation order.
- *block mask* (one long sample dominates): one row ``[1, t]`` with an explicit 4-D
  block-diagonal causal mask ``[1, 1, t, t]``: token i may attend to token j iff both belong to
  the same sample and j <= i. transformers hands a 4-D mask to the attention function as-is, so
  its format follows the implementation: bool (True = attend) for sdpa, additive float
  (0 / finfo.min) for eager.

flash-attention implementations get the ``[1, t]`` row and no mask: they split packed samples by
the position-id resets (varlen kernels), and neither the ``t x t`` mask nor padding is needed.

**bshd (padded).** ``[S, L]`` rows padded to the micro-batch's padded length, with the usual 2-D
padding mask; padding never sits before a real token, so causal attention of real tokens never
sees it.

``model_inputs`` returns the forward's keyword arguments and ``row_index``: the rows of the
flattened model output ``[S * L]`` that predict the micro-batch's response tokens, in
``layout.logit_index`` order, or None when the output already holds only those rows in that
order (thd ``[1, t]``: ``logits_to_keep`` = the index). The LM head only ever sees those rows: the
fused head selects them itself (``FusedRequest.row_index``); a plain head gets them through a
forward pre-hook for the duration of the call, so ``[S * L, V]`` logits are never built.

``micro_batch_logits`` returns the logits rows ``[n_local, V]`` that predict the micro-batch's
response tokens, in ``layout.logit_index`` order: exactly the ``rows`` the loss core expects.

``micro_batch_log_probs`` returns ``(logp, entropy)`` of those rows: with a ``FusedLogProbHead``
installed the model's forward returns them directly (the head gets the response rows' hidden
states and never builds their logits); otherwise from ``micro_batch_logits``.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch

from rl_plugin.backends.attention_mask import block_causal_mask
from rl_plugin.backends.fsdp.vision import VisionTouch, image_inputs, placeholders
from rl_plugin.cp import padded_attention_is_cheaper, segment_grid
from rl_plugin.loss import ForwardOptions, log_probs_and_entropy

FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")


def packed_causal_mask(
    cu_seqlens: torch.Tensor, attn_implementation: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Block-diagonal causal mask ``[1, 1, T, T]`` of samples with boundaries ``cu_seqlens``
    (``rl_plugin.backends.attention_mask``), in the format ``attn_implementation`` takes."""
    total = int(cu_seqlens[-1])
    allowed = block_causal_mask(cu_seqlens, total).view(1, 1, total, total)
    if attn_implementation == "eager":
        zeros = torch.zeros((), dtype=dtype)
        return torch.where(allowed, zeros, torch.tensor(torch.finfo(dtype).min, dtype=dtype))
    return allowed


def thd_as_padded_grid(layout, attn_implementation: str) -> bool:
    """Whether a thd micro-batch runs as the padded grid (module docstring) rather than one row."""
    return (
        layout.qkv_format == "thd"
        and attn_implementation not in FLASH_IMPLEMENTATIONS
        and padded_attention_is_cheaper(layout.local_cu_seqlens)
    )


def model_inputs(
    mb, attn_implementation: str, device: torch.device, padded_grid: Optional[bool] = None, vision=None
) -> Tuple[dict, Optional[torch.Tensor]]:
    """``(kwargs, row_index)`` of the HF model's forward for one ``rl_plugin.loss.MicroBatchInputs`` (or ``MicroBatch``)
    (module docstring). ``padded_grid``: force thd's padded-grid (True) or single-row (False)
    form; default ``thd_as_padded_grid``. ``vision`` (a vision-language model, ``vision.image_inputs``):
    its M-RoPE positions replace the 1-D ones, its image mask is laid out the same way (in place),
    its images join the kwargs."""
    layout = mb.layout
    row_index = None
    positions, place = mb.position_ids, lambda t: t  # the 1-D positions; place: the layout of this form
    if vision is not None:
        positions = vision.pop("positions")
    if layout.qkv_format == "thd":
        if padded_grid is None:
            padded_grid = thd_as_padded_grid(layout, attn_implementation)
        if padded_grid:
            gather, valid = segment_grid(layout.local_cu_seqlens)
            place = lambda t: t[..., gather]  # noqa: E731
            kwargs = dict(input_ids=mb.input_ids[gather], position_ids=place(positions), attention_mask=valid.long())
            # Real cells in row-major order are the packed stream in order (segments contiguous).
            row_index = valid.flatten().nonzero().squeeze(1)[layout.logit_index]
        else:
            place = lambda t: t.unsqueeze(-2)  # noqa: E731 - [n] -> [1, n]; [3, n] -> [3, 1, n]
            kwargs = dict(input_ids=mb.input_ids.view(1, -1), position_ids=place(positions))
            if attn_implementation not in FLASH_IMPLEMENTATIONS:
                kwargs["attention_mask"] = packed_causal_mask(layout.local_cu_seqlens, attn_implementation)
            kwargs["logits_to_keep"] = layout.logit_index
    else:
        kwargs = dict(
            input_ids=mb.input_ids,
            position_ids=positions,
            attention_mask=(layout.input_index >= 0).view(layout.num_samples, -1).long(),
        )
        row_index = layout.logit_index
    if vision is not None:
        if vision.get("image_mask") is not None:
            vision["image_mask"] = place(vision["image_mask"])
        kwargs.update(pixel_values=vision["pixel_values"], image_grid_thw=vision["image_grid_thw"])
    kwargs = {k: v.to(device) for k, v in kwargs.items()}
    kwargs["use_cache"] = False
    return kwargs, None if row_index is None else row_index.to(device)


def real_token_rows(mb, attn_implementation: str, device: torch.device) -> Optional[torch.Tensor]:
    """The rows of ``model_inputs``' flattened input that are real tokens (a bool mask), or None
    where every row is (thd as one row). The MoE router losses count real tokens only."""
    layout = mb.layout
    if layout.qkv_format == "thd":
        if not thd_as_padded_grid(layout, attn_implementation):
            return None
        return segment_grid(layout.local_cu_seqlens)[1].flatten().to(device)
    return (layout.input_index >= 0).flatten().to(device)


@contextlib.contextmanager
def head_sees_rows(model, row_index: Optional[torch.Tensor]):
    """Within the block, the model's output embedding gets only ``hidden.flatten(0, -2)[row_index]``
    (as ``[1, n, H]``) instead of every position's hidden state; nothing when ``row_index`` is None."""
    if row_index is None:
        yield
        return

    def select(module, args):
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1])[row_index].unsqueeze(0), *args[1:])

    handle = model.get_output_embeddings().register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


def micro_batch_logits(model, mb, attn_implementation: str, device: torch.device) -> torch.Tensor:
    """Logits rows ``[n_local, V]`` aligned with ``mb.targets`` (see module docstring)."""
    vision = image_inputs(model, mb)
    kwargs, row_index = model_inputs(mb, attn_implementation, device, vision=vision)
    with head_sees_rows(model, row_index), images_placed(model, vision) as seen:
        logits = model(**kwargs).logits
    return seen.touch(logits.view(-1, logits.shape[-1]))  # only the kept rows, in index order


@contextlib.contextmanager
def images_placed(model, vision):
    """``vision.placeholders`` for a vision-language model's call, nothing for a text model."""
    if vision is None:
        yield VisionTouch()
        return
    with placeholders(model, vision.get("image_mask")) as seen:
        yield seen


def micro_batch_log_probs(model, mb, options: ForwardOptions, attn_implementation: str, device: torch.device):
    """``(logp, entropy)`` ``[n_local]`` aligned with ``mb.targets`` (see module docstring)."""
    from rl_plugin.backends.fsdp.model import FusedLogProbHead, FusedRequest

    targets = mb.targets.to(device)
    head = model.get_output_embeddings()
    if not isinstance(head, FusedLogProbHead):
        rows = micro_batch_logits(model, mb, attn_implementation, device)
        return log_probs_and_entropy(
            rows,
            targets,
            temperature=options.temperature,
            chunk_size=options.chunk_size,
            with_entropy=options.with_entropy,
        )
    vision = image_inputs(model, mb)
    kwargs, row_index = model_inputs(mb, attn_implementation, device, vision=vision)
    request = FusedRequest(targets=targets, options=options, row_index=row_index)
    with head.fused(request), images_placed(model, vision) as seen:
        out = model(**kwargs).logits  # [1, n, 2]
    logp, ent = seen.touch(out.view(-1, 2)).unbind(1)
    return logp, ent
