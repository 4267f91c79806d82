"""The Megatron backend's share of a step: its forward, its schedule, its optimizer step.

The step is the core's (``rl_plugin.loss.runner.StepRunner``); this module supplies::

    forward(model, mb, opts)  -> [n, 2] (logp, entropy)   forward.response_log_probs (fused head,
                                                          or logits + log_probs_and_entropy)
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
tensor. The forward-only pass needs no gradient synchronisation, so it is a plain loop.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Tuple

import torch

from rl_plugin.backends.megatron.forward import response_log_probs
from rl_plugin.loss import ForwardOptions, MicroBatchInputs
from rl_plugin.parallel import ParallelState


def cancel_factor(num_microbatches: int, ps: ParallelState) -> float:
    """The factor that cancels megatron-core's micro-batch and DP x CP averaging (see module doc)."""
    return float(num_microbatches * ps.dp_size)


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
    routing=None,
) -> torch.Tensor:
    """``[n_local, 2]`` (log-prob, entropy) of one micro-batch on ``device`` (the model's);
    ``routing``: the pass's ``routing_replay.RoutingPass`` (None: the routers route freely)."""
    if inputs.layout.num_samples == 0:
        # A DP rank with no sample this step runs one empty micro-batch (peers may run more: the
        # cancel factor is per rank). A zero leaf keeps the schedule's backward valid.
        return torch.zeros((0, 2), device=device, requires_grad=torch.is_grad_enabled())
    with routing.context(model, inputs, qkv_format) if routing is not None else contextlib.nullcontext():
        logp, ent = response_log_probs(
            model, inputs, options, ps, qkv_format=qkv_format, fp32_lm_head=fp32_lm_head, fused=fused
        )
    return torch.stack([logp, ent], 1)


def run_schedule(
    model,
    optimizer,
    ps: ParallelState,
    num_micro_batches: int,
    forward: Callable[[int], torch.Tensor],
    loss: Callable[[int, torch.Tensor], torch.Tensor],
    *,
    forward_only: bool,
) -> int:
    """Megatron's schedule over this rank's micro-batches (module docstring); returns M."""
    if forward_only:
        for i in range(num_micro_batches):
            loss(i, forward(i))
        return num_micro_batches
    from megatron.core.pipeline_parallel import get_forward_backward_func

    m = max(num_micro_batches, 1)  # a rank with no sample runs one empty micro-batch
    scale = cancel_factor(m, ps)

    def forward_step(data_iterator, model_chunk):
        i = next(data_iterator)
        return forward(i), (lambda out: (loss(i, out) * scale, {}))

    model.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(range(m)),
        model=[model],
        num_microbatches=m,
        seq_length=1,
        micro_batch_size=1,
        forward_only=False,
    )
    return m


def optimizer_step(optimizer, scheduler) -> Tuple[float, float]:
    """``(grad_norm, lr)``: ``lr`` read before ``scheduler.step()`` moves it to the next step's."""
    lr_used = float(optimizer.param_groups[0]["lr"])
    update_ok, grad_norm, _ = optimizer.step()
    if not update_ok:
        raise FloatingPointError("the optimizer skipped the step (inf/NaN gradients)")
    scheduler.step(increment=1)
    return (float(grad_norm) if grad_norm is not None else float("nan")), lr_used
