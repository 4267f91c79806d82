"""The Megatron backend's share of a step: its forward, its schedule, its optimizer step.

The step is the core's (``rl_plugin.loss.runner.StepRunner``); this module supplies::

    forward(model, mb, opts)  -> [n, 2] (logp, entropy)   forward.response_log_probs (fused head,
                                                          or logits + log_probs_and_entropy)
                              -> [n, 1] values            value_head.response_values (opts.values:
                                                          the value model, issue 47)
    schedule(model, M, forward, loss)                     get_forward_backward_func() over the M
        forward_step: out = forward(i); loss_func: return loss(i, out) * CANCEL, {}
    optimizer_step()          -> (grad_norm, lr)          optimizer.step(); scheduler.step()

Exactly dJ/dtheta. Summed over every micro-batch of every DP x CP rank, ``loss(i, out)`` is J.
megatron-core 0.16.1 scales what we return twice:

- ``schedules.forward_step_calc_loss`` (2-tuple loss path, l. 266-269):
  ``output_tensor *= cp_group_size; output_tensor /= num_microbatches``;
- DDP (``calculate_per_token_loss=False``): gradients are summed over the DP x CP group and
  scaled by ``1 / dp_cp_size`` (``distributed_data_parallel.py`` l. 174-191).

So the applied gradient is ``sum_ranks d(returned)/dtheta * cp / (M * dp * cp)``, and
``CANCEL = M * dp_size`` makes it ``sum_ranks d(objective)/dtheta = dJ/dtheta``. M is each
rank's OWN micro-batch count, so DP ranks may run different counts (uneven shards, a rank with no
sample: it runs one empty micro-batch); with PP = 1 nothing else requires equal counts. The
reported loss is the runner's J (``ctx.finish()``), never the schedule's (divided, in-place) loss
tensor. The forward-only pass needs no gradient synchronisation, so at one pipeline stage it is a
plain loop.

Pipeline parallelism (``--pipeline-model-parallel-size`` > 1): the same ``get_forward_backward_func``
(1F1B without interleaving) over the stages; every stage of a DP replica holds the same samples and
plan, so M is equal along the pipeline. ``forward(i)`` returns the stage's output activations
(``forward.stage_output``) on every stage but the last, where it returns the log-probs and the
schedule calls ``loss_func``; megatron sends activations and gradients over the pipeline group,
shapes first (``variable_seq_lengths``: thd micro-batches differ in length). The loss is scaled as
above, on the last stage only, and the gradient reaches the earlier stages through the P2P
backward, so the cancel factor is unchanged. ``finalize_model_grads`` all-reduces the tied
embedding's gradient over megatron's embedding group (first and last stage). The forward-only
pass runs the same pipelined schedule with ``forward_only=True``. A DP rank with no sample runs an
idle micro-batch through every stage (``_pipelined_forward``).

Expert parallelism (EP > 1): every forward is collective over the EP group (the token
dispatcher's all-to-alls), so every rank runs the same number of passes P = the largest
micro-batch count over DP x CP, a rank past its own M running idle passes (pad tokens through the
model, padded as a micro-batch is under SP and CP: ``idle_forward``; output times 0, as the FSDP
backend does). megatron-core then divides by P, not M, and
scales the MoE aux / z losses' gradient by ``grad_scale_func(1) * cp / P`` (``schedules.py``
l. 281-292); ``PassScale`` (the model config's ``grad_scale_func``) multiplies both the main loss
(``backward_step`` l. 477) and that scale by ``w = P / M`` on a real pass and by 0 on an idle one,
and ``CANCEL = M * dp_size`` as before: the applied gradient is again dJ/dtheta, the aux losses'
share is their mean over this rank's M micro-batches (Megatron-LM's), and an idle pass adds
exactly nothing, so EP = 2 gives EP = 1's step. Without expert parallelism P = M, w = 1 and
nothing changes.

Interleaved schedule (``chunks.ModelChunks``: V model chunks per pipeline rank): the list of chunks
and one data iterator per chunk go to the same ``get_forward_backward_func`` (megatron returns
``forward_backward_pipelining_with_interleaving``); the forward step tells the model which chunk
runs (``ModelChunks.current``), the runner's ``forward(i)`` is called once per chunk and returns
activations on every chunk but the last chunk of the last rank, where the loss runs. M is padded
to a multiple of P (``interleaved_count``) with idle micro-batches, and the cancel factor uses the
padded M (megatron divides by it; the idle ones add exactly 0).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Tuple

import torch

from rl_plugin.backends.megatron.chunks import ModelChunks, chunks_of
from rl_plugin.backends.megatron.forward import (
    hidden_states_only,
    idle_inputs,
    model_inputs,
    response_log_probs,
    sequence_parallel_size,
    stage_output,
    unwrap,
)
from rl_plugin.backends.megatron.value_head import response_values
from rl_plugin.loss import ForwardOptions, MicroBatchInputs
from rl_plugin.parallel import ParallelState


def cancel_factor(num_microbatches: int, ps: ParallelState) -> float:
    """The factor that cancels megatron-core's micro-batch and DP x CP averaging (see module doc)."""
    return float(num_microbatches * ps.dp_size)


class PassScale:
    """The model config's ``grad_scale_func``: the optimizer's loss scale times this pass's ``w``
    (module docstring); ``w`` is 1 outside an expert-parallel train step."""

    def __init__(self, scale_loss: Callable[[torch.Tensor], torch.Tensor]):
        self.scale_loss, self.w = scale_loss, 1.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        scaled = self.scale_loss(x)
        return scaled if self.w == 1.0 else scaled * self.w


def idle_forward(
    model, device: torch.device, *, cp_rank: int = 0, cp_size: int = 1, qkv_format: str = "thd", values: bool = False
):
    """An idle pass (EP > 1, module docstring): pad tokens through the model so this rank joins its
    EP peers' all-to-alls; ``[0, 2]`` (``values``: ``[0, 1]``, the value model's hidden states, its
    head being no vocabulary projection), carrying the graph so the backward joins them too.

    The input is ``forward.idle_inputs`` in the run's layout, not one bare token: under
    ``--sequence-parallel`` (which MoE needs at TP > 1) megatron-core scatters the sequence over
    TP, and under CP > 1 the attention cuts each rank's share into two zigzag chunks, so the
    length follows the packed micro-batches' padding rules (``cp.sequence_parallel_padding``;
    one token is an invalid shape under either, issue 37 item 4)."""
    from rl_plugin.backends.megatron.moe import untracked

    mb = idle_inputs(
        cp_rank=cp_rank, cp_size=cp_size, qkv_format=qkv_format, sp_size=sequence_parallel_size(unwrap(model))
    )
    ids, pos, psp = model_inputs(mb, qkv_format, sp_size=sequence_parallel_size(unwrap(model)), device=device)
    with untracked(), hidden_states_only(unwrap(model)) if values else contextlib.nullcontext():
        # its router losses are no sample's: not logged (their gradient: w = 0)
        logits = model(ids, pos, None, packed_seq_params=psp)
    return (logits.float().sum() * 0.0).expand(0, 1 if values else 2)


def passes_over(num_micro_batches: int, ps: ParallelState) -> int:
    """P: the largest micro-batch count (at least 1) over DP x CP (CPU group; collective)."""
    from rl_plugin.parallel import all_reduce

    n = torch.tensor([max(num_micro_batches, 1)], dtype=torch.long)
    return int(all_reduce(n, ps.dp_cp_group, torch.distributed.ReduceOp.MAX).item())


def micro_batch_forward(
    model,
    inputs: MicroBatchInputs,
    options: ForwardOptions,
    ps: ParallelState,
    device: torch.device,
    *,
    qkv_format: str,
    fp32_lm_head: bool,
    fused: bool,
    idle_passes: bool = False,
    routing=None,
) -> torch.Tensor:
    """``[n_local, 2]`` (log-prob, entropy) of one micro-batch on ``device`` (the model's), or
    ``[n_local, 1]`` values with ``options.values`` (the value model); on a
    pipeline stage before the last, the stage's output activations (``forward.stage_output``);
    ``idle_passes`` (EP > 1, one pipeline stage): an empty micro-batch runs ``idle_forward``;
    ``routing``: the pass's ``routing_replay.RoutingPass`` (None: the routers route freely; an
    idle pass always does)."""
    values = options.values
    if inputs.layout.num_samples == 0 and idle_passes:
        layout = inputs.layout
        return idle_forward(
            model, device, cp_rank=layout.cp_rank, cp_size=layout.cp_size, qkv_format=qkv_format, values=values
        )
    if ps.pp_size > 1:
        head = ps.is_last_stage
        if isinstance(model, ModelChunks):  # interleaved: the chunk the schedule runs; the head on the last
            chunk = model.current
            head = head and model.is_head(chunk)
            model = chunk
        return _pipelined_forward(
            model, inputs, options, ps, head=head, qkv_format=qkv_format, fp32_lm_head=fp32_lm_head, fused=fused
        )
    if inputs.layout.num_samples == 0:
        # A DP rank with no sample this step runs one empty micro-batch (peers may run more: the
        # cancel factor is per rank). A zero leaf keeps the schedule's backward valid.
        return torch.zeros((0, 1 if values else 2), device=device, requires_grad=torch.is_grad_enabled())
    with routing.context(model, inputs, qkv_format) if routing is not None else contextlib.nullcontext():
        if values:
            return response_values(model, inputs, qkv_format)
        logp, ent = response_log_probs(
            model, inputs, options, ps, qkv_format=qkv_format, fp32_lm_head=fp32_lm_head, fused=fused
        )
    return torch.stack([logp, ent], 1)


def _pipelined_forward(model, inputs, options, ps, *, head, qkv_format, fp32_lm_head, fused) -> torch.Tensor:
    """``micro_batch_forward`` under pipeline parallelism. An empty micro-batch (a DP rank with no
    sample) runs ``forward.idle_inputs`` instead: the stages still exchange activations and
    gradients, and the last stage returns a ``[0, 2]`` slice of the idle log-probs, so the loss
    (``out.sum() * 0``) backpropagates exact zeros through every stage."""
    idle = inputs.layout.num_samples == 0
    if idle:
        layout = inputs.layout
        sp_size = sequence_parallel_size(unwrap(model))
        inputs = idle_inputs(cp_rank=layout.cp_rank, cp_size=layout.cp_size, qkv_format=qkv_format, sp_size=sp_size)
    if not head:  # a stage (a model chunk) before the last
        return stage_output(model, inputs, qkv_format)
    if options.values:
        out = response_values(model, inputs, qkv_format)
    else:
        logp, ent = response_log_probs(
            model, inputs, options, ps, qkv_format=qkv_format, fp32_lm_head=fp32_lm_head, fused=fused
        )
        out = torch.stack([logp, ent], 1)
    return out[:0] if idle else out


def run_schedule(
    model,
    optimizer,
    ps: ParallelState,
    num_micro_batches: int,
    forward: Callable[[int], torch.Tensor],
    loss: Callable[[int, torch.Tensor], torch.Tensor],
    *,
    forward_only: bool,
    pass_scale: Optional[PassScale] = None,
) -> int:
    """Megatron's schedule over this rank's micro-batches (module docstring); returns the passes
    run (M; P with expert parallelism, signalled by ``pass_scale``). Forward only: a plain loop at
    one pipeline stage, megatron's pipelined schedule beyond. Interleaved (``ModelChunks``): M
    padded with idle micro-batches to ``interleaved_count``."""
    m = max(num_micro_batches, 1)  # a rank with no sample runs one empty micro-batch
    chunks = chunks_of(model)
    if len(chunks) > 1:
        m = interleaved_count(m, ps.pp_size)
    passes = passes_over(num_micro_batches, ps) if pass_scale is not None else m
    if forward_only and ps.pp_size == 1:
        n = passes if pass_scale is not None else num_micro_batches
        for i in range(n):
            loss(i, forward(i))
        return n
    from megatron.core.pipeline_parallel import get_forward_backward_func

    scale = 1.0 if forward_only else cancel_factor(m, ps)

    def forward_step(data_iterator, model_chunk):
        i = next(data_iterator)
        if pass_scale is not None:
            pass_scale.w = passes / num_micro_batches if i < num_micro_batches else 0.0
        if len(chunks) > 1:
            model.set_current(model_chunk)
        return forward(i), (lambda out: (loss(i, out) * scale, {}))

    if not forward_only:
        model.zero_grad_buffer()
        optimizer.zero_grad()
    try:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(range(passes)) for _ in chunks] if len(chunks) > 1 else iter(range(passes)),
            model=chunks,
            num_microbatches=passes,
            seq_length=1,  # shapes travel with each P2P message (variable_seq_lengths)
            micro_batch_size=1,
            forward_only=forward_only,
        )
    finally:
        if pass_scale is not None:
            pass_scale.w = 1.0
    return passes


def interleaved_count(m: int, pp: int) -> int:
    """The micro-batch count the interleaved schedule runs for this rank's ``m``: megatron-core
    0.16.1 (``schedules.forward_backward_pipelining_with_interleaving``, micro-batch groups of
    ``microbatch_group_size_per_vp_stage`` = P by default) refuses M < P and M % P in (0, P), i.e.
    it needs a multiple of P. The plan is padded with idle micro-batches (pad tokens, loss x 0:
    exactly nothing added to J or the gradient; the cancel factor counts them, as megatron divides
    by them)."""
    return -(-m // pp) * pp


def optimizer_step(optimizer, scheduler) -> Tuple[float, float]:
    """``(grad_norm, lr)``: ``lr`` read before ``scheduler.step()`` moves it to the next step's."""
    lr_used = float(optimizer.param_groups[0]["lr"])
    update_ok, grad_norm, _ = optimizer.step()
    if not update_ok:
        raise FloatingPointError("the optimizer skipped the step (inf/NaN gradients)")
    scheduler.step(increment=1)
    return (float(grad_norm) if grad_norm is not None else float("nan")), lr_used
