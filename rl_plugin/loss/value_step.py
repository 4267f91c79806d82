"""The critic's step on the shared core: forward-only values and one value-model optimizer step.

``StepRunner`` (``runner.py``) inherits both from ``ValueSteps``; a backend built as a VALUE
model (``TrainConfig.value_head``: the actor's architecture with a scalar head) answers
``ForwardOptions(values=True)`` with ``[n_local, 1]`` fp32 values V(s_t), one per local response
token t, read at the position whose logits would give t's log-prob::

    values = runner.values(model, batch)                        # [sum R_i] fp32 CPU, forward only
    report = runner.value_step(model, batch, num_groups=P)      # one optimizer step of the critic

``values`` is the log-prob pass with the scalar head: the same plan, the same
``schedule(..., forward_only=True)`` under ``torch.no_grad`` in eval mode, and the same CP gather
of each micro-batch's chunks back into full responses (``comm.gather_micro_batch_responses``).

``value_step`` is ``train_step`` with the clipped value loss in place of the policy objective.
With the critic's new predictions v'_t, the batch's old ``values`` v_t and ``returns`` R_t (GAE
targets), the clip c (``--value-clip``) and the step's loss mask m::

    l_t = 0.5 * max((v'_t - R_t)^2, (v_t + clamp(v'_t - v_t, -c, c) - R_t)^2)   (value.value_loss_terms)
    J   = sum_t w_t l_t,  w = token_weights(--loss-aggregation, global counts, m, ...)

the weights built ONCE per step from the global counts (one all-reduce over DP, as the policy
loss: ``counts.compute_step_counts``), so summing each micro-batch's share over every micro-batch
of every DP x CP rank is exactly J, for any layout, and the single-process reference
``value.value_loss(vpreds, returns, values, mask, c, mode)`` gives the same J on the unsliced
step. A CP rank weighs its local tokens only (weights live on tokens: no gather in the loss).
The backend's ``schedule`` backpropagates each share times the factor cancelling its own
averaging, so the applied gradient is dJ/dtheta. ``--deepspeed-grad-scale``, TIS, KL, entropy
and the custom policy reducer belong to the policy objective and do not apply here.

Report (identical on every rank; the last pipeline stage's, broadcast): ``value_loss`` = J,
``vf_clipfrac`` = the token mean over trained tokens of [|v' - v| > c and the clipped error is
the larger],
``values_mean`` = the token mean of v' over trained tokens (the training forward's predictions),
``grad_norm`` and ``lr`` (``backend.optimizer_step``), ``num_micro_batches`` (passes per rank).
The token means are over the step's global trained-token total (sum of m), whatever the mode.

The clip c reaches the step as ``value_step(..., value_clip=c)`` (``TrainBackend.value_train_step``
likewise): ``--value-clip`` is the run's critic setting, not a field of the backend's configs, so
its caller passes it; the default is the flag's default (0.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

from rl_plugin.cp import exclusive_cumsum, expand_runs
from rl_plugin.loss.aggregation import token_weights, weighted_sum
from rl_plugin.loss.backend_api import ForwardOptions, MicroBatchInputs
from rl_plugin.loss.batch import StepBatch
from rl_plugin.loss.counts import StepCounts, compute_step_counts
from rl_plugin.loss.errors import BadBatchError
from rl_plugin.loss.metrics import MetricAccumulator
from rl_plugin.loss.value import value_loss_terms
from rl_plugin.loss_config import LossConfig
from rl_plugin.parallel import ParallelState, broadcast_object_from_last_stage

DEFAULT_VALUE_CLIP = 0.2  # --value-clip's default (slime's)
VALUE_METRICS = ("value_loss", "vf_clipfrac", "values_mean")
_EMPTY = torch.zeros(0, dtype=torch.long)


@dataclass
class ValueMicroBatch:
    """One micro-batch of a value step: the model inputs and, on the loss device, the step-level
    index of each local response token (``local``) with its slices of the step's tensors."""

    inputs: MicroBatchInputs
    local: torch.Tensor
    values: torch.Tensor
    returns: torch.Tensor
    weights: torch.Tensor
    token_mean_weights: torch.Tensor


class ValueStepContext:
    """The value step's per-token tensors on the loss device, moved there once (as ``StepContext``)."""

    def __init__(
        self,
        batch: StepBatch,
        cfg: LossConfig,
        ps: ParallelState,
        counts: StepCounts,
        *,
        value_clip: float,
        device: Optional[torch.device] = None,
    ):
        if batch.values is None or batch.returns is None:
            missing = " and ".join(n for n in ("values", "returns") if getattr(batch, n) is None)
            raise BadBatchError(
                f"a value step needs the critic's old values and the GAE returns per response token; "
                f"the step batch has no {missing}"
            )
        if not value_clip > 0:
            raise ValueError(f"value step: --value-clip must be > 0, got {value_clip}")
        self.batch, self.cfg, self.ps, self.counts, self.value_clip = batch, cfg, ps, counts, float(value_clip)
        self.device = device = torch.device("cpu") if device is None else torch.device(device)
        w = token_weights(
            cfg.loss_aggregation,
            counts,
            batch.loss_mask,
            batch.response_lengths,
            batch.group_ids,
            cfg.loss_aggregation_divisor,
        )
        w_tok = token_weights("token_mean", counts, batch.loss_mask, batch.response_lengths, batch.group_ids)
        self.weights, self.token_mean_weights = w.to(device), w_tok.to(device)
        self.values, self.returns = batch.values.to(device), batch.returns.to(device)
        self._resp_offsets = exclusive_cumsum(batch.response_lengths.long())
        self.metrics = MetricAccumulator(device)

    def micro_batch(self, sample_index) -> ValueMicroBatch:
        sample_index = torch.as_tensor(sample_index, dtype=torch.long).reshape(-1)
        inputs = MicroBatchInputs.build(
            self.batch.select(sample_index),
            cp_rank=self.ps.cp_rank,
            cp_size=self.ps.cp_size,
            qkv_format=self.cfg.qkv_format,
            max_seq_len=self.cfg.max_seq_len,
        )
        step_resp = expand_runs(self._resp_offsets[sample_index], self.batch.response_lengths.long()[sample_index])
        local = step_resp[inputs.layout.resp_index].to(self.device, non_blocking=True)
        return ValueMicroBatch(
            inputs=inputs,
            local=local,
            values=self.values[local],
            returns=self.returns[local],
            weights=self.weights[local],
            token_mean_weights=self.token_mean_weights[local],
        )

    def loss(self, vpreds: torch.Tensor, mb: ValueMicroBatch) -> torch.Tensor:
        """This micro-batch's share of J from its CP-local predictions ``vpreds`` ``[n_local]``."""
        if vpreds.shape[0] != mb.local.shape[0]:
            raise ValueError(
                f"values have {vpreds.shape[0]} rows, the micro-batch has {mb.local.shape[0]} local response tokens"
            )
        dtype = vpreds.dtype
        per_token, clipped = value_loss_terms(vpreds, mb.returns.to(dtype), mb.values.to(dtype), self.value_clip)
        objective = weighted_sum(per_token, mb.weights.to(dtype))
        w_tok = mb.token_mean_weights.to(dtype)
        self.metrics.add("value_loss", objective)
        self.metrics.add("vf_clipfrac", weighted_sum(clipped.to(dtype), w_tok))
        self.metrics.add("values_mean", weighted_sum(vpreds.detach(), w_tok))
        return objective

    def finish(self) -> Dict[str, Optional[float]]:
        """J and the metrics of the step; collective over DP x CP (call on every rank)."""
        return self.metrics.reduce(self.ps, VALUE_METRICS)


def prepare_value_step(
    batch: StepBatch,
    cfg: LossConfig,
    ps: ParallelState,
    *,
    num_groups: Optional[int] = None,
    value_clip: float = DEFAULT_VALUE_CLIP,
    device: Optional[torch.device] = None,
) -> ValueStepContext:
    """Validate this rank's step data, compute the global counts once (one all-reduce over DP)
    and move the step's per-token tensors to the loss ``device`` once."""
    batch.validate()
    counts = compute_step_counts(batch, ps, num_groups)
    return ValueStepContext(batch, cfg, ps, counts, value_clip=value_clip, device=device)


class ValueSteps:
    """``StepRunner``'s critic passes (module docstring); needs the runner's ``backend``, ``cfg``,
    ``ps``, ``plan`` and ``forward_only``."""

    def values(self, model, batch: StepBatch, micro_batches: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
        """The value model's V(s_t) of every response token, ``[sum R_i]`` fp32, full responses,
        batch order, on the CPU (forward only, as ``log_probs``)."""
        options = ForwardOptions.of(self.cfg, with_entropy=False, values=True)
        return self.forward_only(model, batch, micro_batches, options)

    def value_step(
        self,
        model,
        batch: StepBatch,
        *,
        num_groups: int,
        micro_batches: Optional[Sequence[torch.Tensor]] = None,
        value_clip: float = DEFAULT_VALUE_CLIP,
    ) -> Dict[str, float]:
        """One optimizer step of the value model on ``batch`` (with ``values`` and ``returns``):
        ``value_loss``, ``vf_clipfrac``, ``values_mean``, ``grad_norm``, ``lr``,
        ``num_micro_batches``, identical on every rank (module docstring)."""
        backend, cfg, ps = self.backend, self.cfg, self.ps
        ctx = prepare_value_step(
            batch, cfg, ps, num_groups=num_groups, value_clip=value_clip, device=backend.loss_device
        )
        plan = self.plan(batch, micro_batches)
        options = ForwardOptions.of(cfg, with_entropy=False, values=True)
        last = ps.is_last_stage  # pipeline: only the last stage calls loss(i, out)
        pending = {}

        def forward(i: int) -> torch.Tensor:
            mb = ctx.micro_batch(plan[i] if i < len(plan) else _EMPTY)
            if last:
                pending[i] = mb
            return backend.forward(model, mb.inputs, options)

        def loss(i: int, out: torch.Tensor) -> torch.Tensor:
            mb = pending.pop(i)
            if mb.inputs.layout.num_samples == 0:
                return out.sum() * 0.0  # contributes exactly 0; its backward keeps the schedule valid
            return ctx.loss(out[:, 0], mb)

        model.train()
        passes = backend.schedule(model, len(plan), forward, loss, forward_only=False)
        grad_norm, lr = backend.optimizer_step()
        report = broadcast_object_from_last_stage(ctx.finish() if last else None, ps)
        report.update(grad_norm=grad_norm, lr=lr, num_micro_batches=float(passes))
        return report
