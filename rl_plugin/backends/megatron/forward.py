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

In true on-policy mode (``invariant_spec``) ``response_log_probs`` takes the final hidden rows
through the loss core's ``invariant_head`` instead (the op library's head and log-softmax).

``response_log_probs`` is what the step and the forward-only passes call: by default (the model
allows it: no output bias, no multi-token prediction, and ``--disable-fused-lm-head`` unset) it
takes the same final hidden rows and the output weight shard and runs the loss core's
``fused_log_probs_and_entropy``, so the ``[n, V/tp]`` logits are never built; otherwise it
projects (``response_logits``) and calls ``log_probs_and_entropy``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Tuple

import torch

from rl_plugin.cp import expand_runs, sequence_parallel_padding, zigzag_chunks
from rl_plugin.loss import (
    ForwardOptions,
    MicroBatchInputs,
    TargetOutOfVocabError,
    default_chunk_rows,
    fp32_output_projection,
    fused_log_probs_and_entropy,
    invariant_log_probs_and_entropy,
    log_probs_and_entropy,
)

# set on a GPTModel whose modules compute through rl_plugin.invariant (invariant_spec.apply)
TRUE_ON_POLICY = "rl_true_on_policy"


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def model_inputs(mb: MicroBatchInputs, qkv_format: str, *, sp_size: int = 1, device=None):
    """``(input_ids, position_ids, packed_seq_params)`` of a micro-batch for GPTModel.forward.

    ``device``: the model's device (None: where the layout is, the CPU). The ids, the positions
    and every ``cu_seqlens`` tensor of the ``PackedSeqParams`` go there: transformer-engine's thd
    attention (and its CP kernels) read ``cu_seqlens(_padded)`` on the GPU, so a host tensor fails
    the first forward of a GPU run (issue 37, item 1).

    ``sp_size``: the TP size under ``--sequence-parallel`` (1 otherwise, and then nothing
    changes). megatron-core's SP scatter splits the sequence dimension over TP, so it must
    divide by TP: ``thd`` appends one padding segment (``cp.sequence_parallel_padding``: the
    packed length becomes a multiple of TP*CP; its zigzag share on this CP rank, its own entry in
    ``cu_seqlens``, so no sample attends to it); ``bshd`` at CP = 1 pads every row at its end
    (causal: no real token attends to it). Padding rows are never read: ``logit_index`` keeps
    the real rows (``padded_logit_index``)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    layout = mb.layout
    if qkv_format == "bshd":
        ids, pos = mb.input_ids, mb.position_ids
        extra = -ids.shape[-1] % sp_size
        if extra:
            if layout.cp_size > 1:
                raise ValueError(
                    f"--sequence-parallel with --qkv-format bshd: the rows are {ids.shape[-1]} tokens per CP rank "
                    f"(--seq-length padded to 2*CP, / CP={layout.cp_size}), not a multiple of "
                    f"--tensor-model-parallel-size {sp_size}. Fix: a --seq-length that is a multiple of "
                    f"{math.lcm(2 * layout.cp_size, sp_size * layout.cp_size)}, or --qkv-format thd"
                )
            width = ids.shape[-1]
            ids = torch.nn.functional.pad(ids, (0, extra))
            more = torch.arange(width, width + extra, dtype=pos.dtype, device=pos.device)
            pos = torch.cat([pos, more.expand(pos.shape[0], extra)], dim=1)
        return _to(ids, device), _to(pos, device), None
    cu = layout.cu_seqlens_padded
    max_len = int(layout.padded_lengths.max()) if layout.num_samples else 0
    ids, pos = mb.input_ids, mb.position_ids
    extra = sequence_parallel_padding(int(cu[-1]), sp_size, layout.cp_size) if sp_size > 1 else 0
    if extra:
        starts, lengths = zigzag_chunks(torch.tensor([extra]), layout.cp_rank, layout.cp_size)
        pad_pos = expand_runs(starts.reshape(-1), lengths.reshape(-1)).to(pos.dtype)
        ids = torch.cat([ids, ids.new_zeros(pad_pos.numel())])
        pos = torch.cat([pos, pad_pos.to(pos.device)])
        cu = torch.cat([cu, cu[-1:] + extra])
        max_len = max(max_len, extra)
    cu = _to(cu, device)
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
    )
    return _to(ids.view(1, -1), device), _to(pos.view(1, -1), device), psp


def _to(t: torch.Tensor, device) -> torch.Tensor:
    return t if device is None else t.to(device)


def moe_padding_kwargs(gpt, mb: MicroBatchInputs, input_ids: torch.Tensor) -> dict:
    """``{"padding_mask": [b, s] bool}`` for an MoE model's forward, True at the padding positions
    of ``input_ids`` (``model_inputs``: CP and bshd padding, ``input_index`` -1, and the
    sequence-parallel padding): megatron-core 0.16.1 then leaves them out of the router's aux
    losses, z-loss and expert-bias counts, which count real tokens only (as the FSDP backend's
    ``router_losses``). ``{}`` for a dense model."""
    if not getattr(gpt.config, "num_moe_experts", None):
        return {}
    pad = mb.layout.input_index.reshape(mb.input_ids.shape) < 0
    if pad.dim() == 1:
        pad = pad.view(1, -1)
    extra = input_ids.shape[-1] - pad.shape[-1]
    if extra:
        pad = torch.nn.functional.pad(pad, (0, extra), value=True)
    return {"padding_mask": pad.view(input_ids.shape)}


def padded_logit_index(mb: MicroBatchInputs, input_ids: torch.Tensor) -> torch.Tensor:
    """``mb.layout.logit_index`` into the model output of ``input_ids`` (``model_inputs``): the
    same except for ``bshd`` rows widened under sequence parallelism (``b``-major flattening:
    row ``i`` moves by ``i * extra``). thd's padding segment sits after every real row."""
    index = mb.layout.logit_index
    width = mb.input_ids.shape[-1]
    if mb.input_ids.dim() == 2 and input_ids.shape[-1] != width:
        index = index + index // width * (input_ids.shape[-1] - width)
    return index


def sequence_parallel_size(gpt) -> int:
    """TP size under ``--sequence-parallel``, else 1 (``model_inputs``'s ``sp_size``)."""
    cfg = gpt.config
    return int(cfg.tensor_model_parallel_size) if cfg.sequence_parallel else 1


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


def output_weight(gpt) -> torch.Tensor:
    """This TP rank's ``[V/tp, H]`` output weight (the input embedding when tied)."""
    return (
        gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else gpt.output_layer.weight
    )


def fused_head_unsupported(model) -> Optional[str]:
    """Why the fused head cannot stand in for this model's output layer, or None (also on a
    pipeline stage without the output layer: only the last stage runs the head)."""
    gpt = language_model(model)
    if not gpt.post_process:
        return None
    if getattr(gpt.output_layer, "bias", None) is not None:
        return "the output layer has a bias"
    if getattr(gpt.config, "mtp_num_layers", None):
        return "multi-token prediction post-processes the hidden states"
    return None


def response_rows(
    hidden: torch.Tensor,
    logit_index: torch.Tensor,
    *,
    sequence_parallel: bool,
    grad_summed_by_caller: bool,
    tp_group=None,
    upcast: bool = False,
) -> torch.Tensor:
    """``[n, H]`` response rows of the final hidden states ``[s(/tp), b, H]``, identical on every TP
    rank, whose backward sums the TP ranks' partial d(rows) EXACTLY ONCE (each rank's head sees
    only its vocab shard, so its d(rows) is a partial sum):

    - sequence parallel: ``hidden`` is this rank's sequence shard; the all-gather's backward
      reduce-scatters, i.e. it already SUMS the partial d(rows) over TP. Nothing on top: an
      all-reduce as well (``copy_to_tensor_model_parallel_region``) multiplied every gradient
      below the head by tp (the bug pinned by ``backends/megatron/test_fp32_head``'s SP test).
    - otherwise: identity forward and all-reduce of d(rows) backward (what ColumnParallelLinear
      does for its input), unless ``grad_summed_by_caller`` (the fused head all-reduces itself).
    ``tp_group``: megatron's TP group when None. ``upcast``: the rows (only) are cast to fp32
    right after indexing, before any TP collective, for bf16 hidden states."""
    from megatron.core import tensor_parallel

    if sequence_parallel:
        hidden = tensor_parallel.gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=True, group=tp_group
        )
    rows = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])[logit_index.to(hidden.device)]
    if upcast:
        rows = rows.float()
    if not sequence_parallel and not grad_summed_by_caller:
        rows = tensor_parallel.copy_to_tensor_model_parallel_region(rows, group=tp_group)
    return rows


def language_model(model):
    """The GPTModel of the model: ``unwrap(model)``, or a vision-language model's ``language_model``
    (``vision.VLModel``: its head, final norm and config are the language model's)."""
    core = unwrap(model)
    return getattr(core, "language_model", None) or core


def call_inputs(model, mb: MicroBatchInputs, qkv_format: str):
    """``(input_ids, position_ids, packed_seq_params, kwargs)`` of the model call for ``mb``: the
    ``model_inputs``, an MoE model's padding mask, and a vision-language model's images, image
    places and 3-D positions (``vision.image_kwargs``, which replace the 1-D positions)."""
    from rl_plugin.backends.megatron.vision import image_kwargs

    gpt = language_model(model)
    device = next(model.parameters()).device
    input_ids, position_ids, psp = model_inputs(mb, qkv_format, sp_size=sequence_parallel_size(gpt), device=device)
    kwargs = {k: v.to(device) for k, v in moe_padding_kwargs(gpt, mb, input_ids).items()}
    images = image_kwargs(model, mb, device)
    if images is not None:
        position_ids = images.pop("position_ids")
        kwargs.update(images)
    return input_ids, position_ids, psp, kwargs


def _response_hidden(model, mb: MicroBatchInputs, qkv_format: str, *, grad_summed_by_caller: bool):
    """``(rows [n, H], gpt)``: the final (normed) hidden states of the response rows
    (``response_rows``), fp32 under ``--bf16``. Without sequence parallelism the bf16 hidden
    states are indexed first and only the rows upcast (bitwise the same rows and gradients as
    the ``Float16Module``'s fp32 output, without its fp32 ``[s, b, H]`` copy); with it the fp32
    output is gathered as before (the gather's reduce-scatter stays in fp32)."""
    gpt = language_model(model)
    input_ids, position_ids, psp, kwargs = call_inputs(model, mb, qkv_format)
    sp = bool(gpt.config.sequence_parallel)
    early = not sp and half_precision_wrapped(model)
    if early:
        kwargs["fp32_output"] = False
    with hidden_states_only(gpt):
        hidden = model(input_ids, position_ids, None, packed_seq_params=psp, **kwargs)  # [s, b, h]
    rows = response_rows(
        hidden,
        padded_logit_index(mb, input_ids),
        sequence_parallel=sp,
        grad_summed_by_caller=grad_summed_by_caller,
        upcast=early,
    )
    return rows, gpt


def half_precision_wrapped(model) -> bool:
    """Whether a megatron ``Float16Module`` (``--bf16``) is in the wrapper chain: its forward casts
    the output to fp32 unless called with ``fp32_output=False``."""
    from megatron.core.transformer.module import Float16Module

    while True:
        if isinstance(model, Float16Module):
            return True
        if not hasattr(model, "module"):
            return False
        model = model.module


def response_logits(model, mb: MicroBatchInputs, *, qkv_format: str, fp32_lm_head: bool) -> torch.Tensor:
    """The unfused path: ``[n, V/tp]`` logits of the response rows.

    Without ``--fp32-lm-head`` the rows are the model's own logits in its dtype: under ``--bf16``
    the ``Float16Module`` is asked for its bf16 output (``fp32_output=False``), the response rows
    are indexed out, and ``log_probs_and_entropy`` upcasts them one chunk at a time. Upcasting
    bf16 is exact, so the log-probs and gradients are bitwise those of the fp32 output; what goes
    is the fp32 ``[b, s, V/tp]`` copy of every position's logits (and its fp32 gradient buffer
    in the backward), ``benchmarks/megatron_bf16_logits.py``."""
    if not fp32_lm_head:
        device = next(model.parameters()).device
        input_ids, position_ids, psp, kwargs = call_inputs(model, mb, qkv_format)
        if half_precision_wrapped(model):
            kwargs["fp32_output"] = False
        logits = model(input_ids, position_ids, None, packed_seq_params=psp, **kwargs)  # [b, s, V/tp]
        return logits.reshape(-1, logits.shape[-1])[padded_logit_index(mb, input_ids).to(device)]
    rows, gpt = _response_hidden(model, mb, qkv_format, grad_summed_by_caller=False)
    return fp32_output_projection(rows, output_weight(gpt))


def response_log_probs(
    model,
    mb: MicroBatchInputs,
    options: ForwardOptions,
    ps,
    *,
    qkv_format: str,
    fp32_lm_head: bool,
    fused: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` of the micro-batch's CP-local response tokens (module docstring). A
    target outside the vocabulary raises ``TargetOutOfVocabError`` naming its step sample."""
    try:
        return _response_log_probs(
            model, mb, options, ps, qkv_format=qkv_format, fp32_lm_head=fp32_lm_head, fused=fused
        )
    except TargetOutOfVocabError as e:
        local = int(mb.layout.sample_ids[e.row])
        index = getattr(mb, "sample_index", None)
        sample = int(index[local]) if index is not None else local
        raise TargetOutOfVocabError(f"sample {sample}: {e}", e.row) from None


def _response_log_probs(
    model,
    mb: MicroBatchInputs,
    options: ForwardOptions,
    ps,
    *,
    qkv_format: str,
    fp32_lm_head: bool,
    fused: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    if getattr(unwrap(model), TRUE_ON_POLICY, False):
        return _invariant_log_probs(model, mb, options, ps, qkv_format)
    if fused:
        rows, gpt = _response_hidden(model, mb, qkv_format, grad_summed_by_caller=True)
        weight = output_weight(gpt)
        return fused_log_probs_and_entropy(
            rows,
            weight,
            mb.targets.to(rows.device),
            temperature=options.temperature,
            tp_group=ps.tp_group,
            vocab_start=ps.tp_rank * weight.shape[0],
            fp32_head=fp32_lm_head,
            with_entropy=options.with_entropy,
            chunk_size=min(options.chunk_size, default_chunk_rows(weight.shape[0], device=weight.device)),
            reduce_hidden_grad=not gpt.config.sequence_parallel,
        )
    rows = response_logits(model, mb, qkv_format=qkv_format, fp32_lm_head=fp32_lm_head)
    return log_probs_and_entropy(
        rows,
        mb.targets.to(rows.device),
        temperature=options.temperature,
        tp_group=ps.tp_group,
        vocab_start=ps.tp_rank * rows.shape[-1],
        chunk_size=options.chunk_size,
        with_entropy=options.with_entropy,
    )


def _invariant_log_probs(model, mb: MicroBatchInputs, options: ForwardOptions, ps, qkv_format: str):
    """True on-policy mode (``invariant_spec``): the response rows through the loss core's
    ``invariant_log_probs_and_entropy`` (the op library's head and log-softmax)."""
    rows, gpt = _response_hidden(model, mb, qkv_format, grad_summed_by_caller=False)
    weight = output_weight(gpt)
    return invariant_log_probs_and_entropy(
        rows.to(weight.dtype),  # under --bf16 the rows were upcast exactly: the head runs in bf16, as HF's
        weight,
        mb.targets.to(rows.device),
        temperature=options.temperature,
        tp_group=ps.tp_group,
        vocab_start=ps.tp_rank * weight.shape[0],
        with_entropy=options.with_entropy,
    )


def stage_output(model, mb: MicroBatchInputs, qkv_format: str) -> torch.Tensor:
    """A pipeline stage before the last: its output activations ``[s, b, h]`` for the micro-batch
    (the schedule sends them to the next stage; on a stage after the first the model reads its
    input from the previous stage, ``set_input_tensor``, and ``input_ids`` only shape the call).
    Every stage builds the same ``position_ids`` and ``PackedSeqParams`` (RoPE, thd attention)."""
    gpt = unwrap(model)
    device = next(model.parameters()).device
    input_ids, position_ids, psp = model_inputs(mb, qkv_format, sp_size=sequence_parallel_size(gpt), device=device)
    return model(input_ids, position_ids, None, packed_seq_params=psp)


def idle_inputs(*, cp_rank: int, cp_size: int, qkv_format: str, sp_size: int = 1) -> MicroBatchInputs:
    """A one-sample micro-batch of pad tokens (id 0; a one-token response, padded to the CP
    chunking) that a rank with no sample runs in place of an empty micro-batch: a
    pipelined DP rank (the stages must exchange real activations and gradients) and an
    expert-parallel rank's idle pass (``step.idle_forward``); its loss is multiplied by 0.

    Its length is valid under every layout the real micro-batches take: ``2 * cp`` tokens (each CP
    rank's two zigzag chunks are non-empty), padded by the same rule as a packed micro-batch under
    ``--sequence-parallel`` (``cp.sequence_parallel_padding``: each CP rank's share divides by TP,
    ``sp_size``), so bshd rows and thd streams alike split over TP without a further segment."""
    from rl_plugin.loss import StepBatch

    total = 2 * cp_size
    total += sequence_parallel_padding(total, sp_size, cp_size) if cp_size > 1 or sp_size > 1 else 0
    batch = StepBatch(
        tokens=torch.zeros(total, dtype=torch.long),
        total_lengths=torch.tensor([total]),
        response_lengths=torch.tensor([1]),
        loss_mask=torch.zeros(1),
        advantages=torch.zeros(1),
        group_ids=torch.zeros(1, dtype=torch.long),
    )
    return MicroBatchInputs.build(batch, cp_rank=cp_rank, cp_size=cp_size, qkv_format=qkv_format, max_seq_len=total)
