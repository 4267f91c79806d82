"""The Megatron train step and forward-only log-probs, on the shared loss core.

Train step (``train_step``):

    ctx = prepare_step(batch, cfg, ps)              # global counts, weights: once per step
    get_forward_backward_func()(forward_step, iter(plan), [model], num_microbatches=M)
        forward_step: mb = ctx.micro_batch(idx); logp, ent = response_log_probs(...)
                      (fused head + log-probs, or logits + log_probs_and_entropy)
        loss_func:    out = ctx.loss(logp, ent, mb)
                      return out.objective * CANCEL, {}
    optimizer.step(); scheduler.step()
    report = ctx.finish()                           # J and metrics, identical on every rank

Exactly dJ/dtheta. Summed over every micro-batch of every DP x CP rank, ``out.objective`` is J.
megatron-core 0.16.1 scales what we return twice:

- ``schedules.forward_step_calc_loss`` (2-tuple loss path, l. 266-269):
  ``output_tensor *= cp_group_size; output_tensor /= num_microbatches``;
- DDP (``calculate_per_token_loss=False``): gradients are summed over the DP x CP group and
  scaled by ``1 / dp_cp_size`` (``distributed_data_parallel.py`` l. 174-191).

So the applied gradient is ``sum_ranks d(returned)/dtheta * cp / (M * dp * cp)``, and
``CANCEL = M * dp_size`` makes it ``sum_ranks d(objective)/dtheta = dJ/dtheta``. M is each
rank's OWN micro-batch count, so DP ranks may run different counts (uneven shards, a rank with no
sample: it runs one empty micro-batch); with PP = 1 nothing else requires equal counts. The
reported loss is ``ctx.finish()``'s J, never the schedule's (divided, in-place) loss tensor.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from rl_plugin.backends.megatron.forward import response_log_probs
from rl_plugin.batching import plan_micro_batches
from rl_plugin.cp import all_rank_layouts, exclusive_cumsum, expand_runs
from rl_plugin.loss import LossConfig, MicroBatchInputs, StepBatch, prepare_step
from rl_plugin.loss.comm import gather_responses
from rl_plugin.parallel import ParallelState


def cancel_factor(num_microbatches: int, ps: ParallelState) -> float:
    """The factor that cancels megatron-core's micro-batch and DP x CP averaging (see module doc)."""
    return float(num_microbatches * ps.dp_size)


def train_step(model, optimizer, scheduler, batch: StepBatch, cfg: LossConfig, ps: ParallelState, *,
               num_groups: int, micro_batches: Optional[List[torch.Tensor]] = None,
               micro_batch_size: int = 1, max_tokens_per_gpu: Optional[int] = None,
               fp32_lm_head: bool = False, fused_lm_head: bool = False) -> Dict[str, float]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ctx = prepare_step(batch, cfg, ps, num_groups=num_groups)
    if micro_batches is None:
        micro_batches = plan_micro_batches(
            batch, micro_batch_size=micro_batch_size, max_tokens_per_gpu=max_tokens_per_gpu, dp_group=ps.dp_group
        )
    plan = list(micro_batches) or [torch.zeros(0, dtype=torch.long)]
    scale = cancel_factor(len(plan), ps)

    def forward_step(data_iterator, model_chunk):
        mb = ctx.micro_batch(next(data_iterator))
        if mb.layout.num_samples == 0:
            # A DP rank with no sample this step runs one empty micro-batch (peers may run more:
            # the cancel factor is per rank). A zero leaf keeps the schedule's backward valid.
            dummy = torch.zeros((), requires_grad=True, device=next(model_chunk.parameters()).device)
            return dummy, lambda out: (out * 0.0, {})
        logp, ent = response_log_probs(
            model_chunk, mb, ps, qkv_format=cfg.qkv_format, fp32_lm_head=fp32_lm_head, fused=fused_lm_head,
            temperature=cfg.temperature, chunk_size=cfg.logprob_chunk_size, with_entropy=cfg.needs_entropy,
        )

        def loss_func(logp_ent):
            # The loss core works on per-token CPU scalars (no-op on CPU; on GPU one [n] copy,
            # differentiable), with CPU-capable groups (setup.init_parallel).
            logp_, ent_ = logp_ent.unbind(1)
            out = ctx.loss(logp_.cpu(), ent_.cpu() if cfg.needs_entropy else None, mb)
            return (out.objective * scale).to(logp_ent.device), {}

        return torch.stack([logp, ent], 1), loss_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    model.train()
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(plan), model=[model], num_microbatches=len(plan),
        seq_length=1, micro_batch_size=1, forward_only=False,
    )
    lr_used = float(optimizer.param_groups[0]["lr"])  # before scheduler.step() moves it to the next step's
    update_ok, grad_norm, _ = optimizer.step()
    if not update_ok:
        raise FloatingPointError("the optimizer skipped the step (inf/NaN gradients)")
    scheduler.step(increment=1)
    report = ctx.finish()
    report["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    report["lr"] = lr_used
    report["num_micro_batches"] = float(len(plan))
    return report


@torch.no_grad()
def forward_log_probs(model, batch: StepBatch, ps: ParallelState, *, qkv_format: str, max_seq_len: Optional[int],
                      temperature: float, chunk_size: int, micro_batches: List[torch.Tensor],
                      fp32_lm_head: bool = False, fused_lm_head: bool = False) -> torch.Tensor:
    """Per-response-token log-probs ``[sum R_i]`` (fp32, full responses, batch order)."""

    was_training = model.training
    model.eval()
    rl = batch.response_lengths.long()
    resp_off = exclusive_cumsum(rl)
    out = torch.zeros(int(rl.sum()), dtype=torch.float32)
    try:
        for idx in micro_batches:
            idx = torch.as_tensor(idx, dtype=torch.long)
            if idx.numel() == 0:
                continue
            sub = batch.select(idx)
            mb = MicroBatchInputs.build(sub, cp_rank=ps.cp_rank, cp_size=ps.cp_size, qkv_format=qkv_format,
                                        max_seq_len=max_seq_len)
            layout = mb.layout
            logp, _ = response_log_probs(model, mb, ps, qkv_format=qkv_format, fp32_lm_head=fp32_lm_head,
                                         fused=fused_lm_head, temperature=temperature, chunk_size=chunk_size,
                                         with_entropy=False)
            layouts = [layout] if ps.cp_size == 1 else all_rank_layouts(
                sub.total_lengths, sub.response_lengths, cp_size=ps.cp_size, qkv_format=qkv_format, max_seq_len=max_seq_len)
            full = gather_responses(logp.float().cpu(), layouts, ps.cp_rank, ps.cp_group)
            out[expand_runs(resp_off[idx], rl[idx])] = full
    finally:
        model.train(was_training)
    return out

