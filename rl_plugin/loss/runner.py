"""The step runner: the core owns the step; a backend supplies forward, schedule and optimizer step.

    runner = StepRunner(backend, micro_batch_size=b, max_tokens_per_gpu=budget)   # cfg: backend.loss_config
    old    = runner.log_probs(model, batch)                   # forward only: old or ref policy
    report = runner.train_step(model, batch, num_groups=P)    # one optimizer step, exactly dJ/dtheta
    values = runner.values(critic, batch)                     # the value model's passes
    report = runner.value_step(critic, batch, num_groups=P)   #   (``value_step.py``)

A train step::

    plan   = runner.plan(batch)                       # THE planner (micro_batch_plan.plan_micro_batches)
    ctx    = prepare_step(batch, cfg, ps, device=backend.loss_device)   # counts, weights: once
    passes = backend.schedule(model, len(plan), forward, loss, forward_only=False)
        forward(i):   mb = ctx.micro_batch(plan[i])          # i >= len(plan): an empty micro-batch
                      return backend.forward(model, mb, options)  # [n_local, 2]: (log-prob, entropy)
        loss(i, out): return ctx.loss(logp, ent, mb).objective   # this micro-batch's share of J
    grad_norm, lr = backend.optimizer_step()
    report = ctx.finish()                             # J and metrics, identical on every rank

Pipeline parallelism (``ps.pp_size > 1``): every stage runs the same plan and ``prepare_step``
(its own copy of the counts and weights, once per step); ``backend.forward`` returns the stage's
output activations on every stage but the last, and the backend's schedule calls ``loss(i, out)``
on the last stage only. So J and the metrics (``finish``) and the forward-only log-probs are the
last stage's, broadcast over the pipeline group once per step / pass
(``parallel.broadcast_object_from_last_stage`` / ``broadcast_from_last_stage``).

The forward-only pass is the same runner without backward: the same plan, the same
``backend.schedule(..., forward_only=True)`` under ``torch.no_grad`` with the model in eval mode;
``loss(i, out)`` gathers the micro-batch's CP chunks back into full responses
(``comm.gather_micro_batch_responses``) and writes them into the ``[sum R_i]`` result.

What a backend implements (``backend_api.StepBackend``, narrow on purpose; ``backends.base.TrainBackend`` adds
weights export and checkpoints):

- ``forward(model, inputs, options)``: one micro-batch (``MicroBatchInputs`` / ``MicroBatch``:
  CP-local ``input_ids``, ``position_ids``, ``targets``, ``layout``) with the pass's
  ``ForwardOptions`` (temperature, chunk size, with_entropy; built once per pass from the loss
  config) -> ``[n_local, 2]`` (log-prob, entropy; entropy zeros without ``with_entropy``) of
  its local response tokens, on ``loss_device``, differentiable. A micro-batch with no sample
  returns a ``[0, 2]`` tensor (that may carry an idle pass's graph, see FSDP).
- ``schedule(model, n, forward, loss, *, forward_only)``: run this rank's ``n`` micro-batches
  (and any idle passes its collectives need), calling ``loss(i, forward(i))`` for each and, when
  training, backpropagating the objective times the factor that cancels the backend's own
  averaging; returns the passes run. Megatron: ``get_forward_backward_func`` with the cancel
  factor M x dp (``backends/megatron/step.py``); FSDP: a loop with idle passes so every DP rank
  runs the same number of passes (``backends/fsdp/backend.py``).
- ``optimizer_step() -> (grad_norm, lr)``: clip, step, schedule the next learning rate; ``lr`` is
  the rate this step used.
- ``loss_device``: the device its log-probs come out on, which is where the loss runs.

Device contract (the loss runs on the device of the logits):

- The step batch arrives on the CPU. Counts and per-token weights are built ONCE per step on the
  CPU (their all-reduce carries CPU scalars) and, with every per-token field of the step
  (``loss_mask``, ``advantages``, old/ref/rollout log-probs, TIS weights, M_i), moved to
  ``loss_device`` ONCE (``StepContext``). A micro-batch moves one index tensor (and its model
  inputs) to the device and gathers its slices there: no per-token tensor is copied per
  micro-batch, none goes back to the CPU in the hot path. Metrics accumulate on the device
  without host synchronisation and cross to the CPU once, in ``finish``. The forward-only result
  is assembled on the device and copied to the CPU once.
- Collectives use groups matching what they carry (``rl_plugin.parallel``): ``tp_group`` and
  ``cp_group`` carry loss-device tensors (vocab-parallel log-prob scalars, GSPO's per-sample
  sums, the CP gather): NCCL on GPU, gloo on CPU. ``dp_group`` and ``dp_cp_group`` carry CPU
  scalars only (step counts, the micro-batch plan, metric vectors): gloo, built as CPU twins of
  the NCCL groups (``parallel.cpu_group``) where the world runs NCCL.

No redundant forward (issue 12): ``train_step(..., old_from_forward=True)`` takes the old
log-probs from the training forward (detached) instead of a separate pass; ``old_log_probs_rule``
says when that gives the same numbers.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from rl_plugin.cp import exclusive_cumsum, expand_runs
from rl_plugin.loss.backend_api import ForwardOptions, MicroBatchInputs, StepBackend
from rl_plugin.loss.batch import StepBatch
from rl_plugin.loss.comm import gather_micro_batch_responses
from rl_plugin.loss.micro_batch_plan import plan_micro_batches
from rl_plugin.loss.off_policy_step import old_from_forward_unsupported
from rl_plugin.loss.step import prepare_step
from rl_plugin.loss.value_step import ValueSteps
from rl_plugin.loss_config import LossConfig
from rl_plugin.parallel import ParallelState, broadcast_from_last_stage, broadcast_object_from_last_stage

_EMPTY = torch.zeros(0, dtype=torch.long)


def old_log_probs_rule(
    *,
    step_bounds: Sequence[Tuple[int, int]],
    num_samples: int,
    cfg: LossConfig,
    ps: ParallelState,
    has_rollout_log_probs: bool,
    deterministic_forward: bool,
) -> Optional[str]:
    """Why a rollout needs its separate old-log-prob pass (None: take them from the training forward).

    The old log-probs are the policy's at the start of the rollout. When the rollout is trained in
    ONE optimizer step covering all of it, the step's forward runs on exactly those weights, with
    the same micro-batches, so its detached log-probs ARE the old log-probs, bit for bit, and the
    separate pass is a redundant forward. It is kept when:

    - the rollout is trained in several optimizer steps (``--global-batch-size`` below the
      rollout, ``--docs-per-step``): steps after the first run on updated weights;
    - the training forward differs from the eval forward (dropout);
    - ``--custom-tis-function-path``: the hook reads the full old log-probs before the loss;
    - context parallelism with rollout log-probs: the mismatch metrics and sequence TIS weights
      need every CP chunk of a response.

    The reference pass (``--use-kl-loss``) is another model's and always runs.
    """
    if len(step_bounds) != 1 or tuple(step_bounds[0]) != (0, num_samples):
        return f"the rollout is trained in {len(step_bounds)} optimizer steps; later steps see updated weights"
    if not deterministic_forward:
        return "the training forward differs from the eval forward (dropout)"
    return old_from_forward_unsupported(cfg, ps.cp_size, has_rollout_log_probs)


class StepRunner(ValueSteps):
    """The train step and the forward-only pass of one backend (module docstring); the critic's
    ``values`` and ``value_step`` come from ``value_step.ValueSteps``."""

    def __init__(self, backend: StepBackend, *, micro_batch_size: int, max_tokens_per_gpu: Optional[int] = None):
        self.backend = backend
        self.micro_batch_size, self.max_tokens_per_gpu = int(micro_batch_size), max_tokens_per_gpu

    @property
    def cfg(self) -> LossConfig:
        return self.backend.loss_config

    @property
    def ps(self) -> ParallelState:
        return self.backend.parallel_state

    def plan(self, batch: StepBatch, micro_batches: Optional[Sequence[torch.Tensor]] = None) -> List[torch.Tensor]:
        """This rank's non-empty micro-batches (sample-index tensors): the loop's plan, or the one
        planner's (``--micro-batch-size`` / ``--use-dynamic-batch-size --max-tokens-per-gpu``,
        collective over DP)."""
        if micro_batches is None:
            micro_batches = plan_micro_batches(
                batch,
                micro_batch_size=self.micro_batch_size,
                max_tokens_per_gpu=self.max_tokens_per_gpu,
                dp_group=self.ps.dp_group,
            )
        plan = [torch.as_tensor(m, dtype=torch.long).reshape(-1) for m in micro_batches]
        return [m for m in plan if m.numel()]

    # -- one optimizer step -------------------------------------------------------------------
    def train_step(
        self,
        model,
        batch: StepBatch,
        *,
        num_groups: int,
        micro_batches: Optional[Sequence[torch.Tensor]] = None,
        old_from_forward: bool = False,
    ) -> Dict[str, float]:
        """J and the metrics, ``grad_norm``, ``lr`` and ``num_micro_batches`` (passes per rank)."""
        backend, cfg = self.backend, self.cfg
        ctx = prepare_step(
            batch, cfg, self.ps, num_groups=num_groups, device=backend.loss_device, old_from_forward=old_from_forward
        )
        plan = self.plan(batch, micro_batches)
        pending = {}
        with_entropy = cfg.needs_entropy
        options = ForwardOptions.of(cfg, with_entropy=with_entropy)

        last = self.ps.is_last_stage  # pipeline: only the last stage calls loss(i, out)

        def forward(i: int) -> torch.Tensor:
            mb = ctx.micro_batch(plan[i] if i < len(plan) else _EMPTY)
            if last:
                pending[i] = mb
            return backend.forward(model, mb, options)

        def loss(i: int, out: torch.Tensor) -> torch.Tensor:
            mb = pending.pop(i)
            if mb.layout.num_samples == 0:
                return out.sum() * 0.0  # contributes exactly 0; its backward keeps the schedule valid
            logp, ent = out.unbind(1)
            return ctx.loss(logp, ent if with_entropy else None, mb).objective

        model.train()
        passes = backend.schedule(model, len(plan), forward, loss, forward_only=False)
        grad_norm, lr = backend.optimizer_step()
        # J and the metrics are the last stage's (the loss ran there); one broadcast per step
        report = broadcast_object_from_last_stage(ctx.finish() if last else None, self.ps)
        report.update(grad_norm=grad_norm, lr=lr, num_micro_batches=float(passes))
        return report

    # -- forward only -------------------------------------------------------------------------
    def log_probs(
        self,
        model,
        batch: StepBatch,
        micro_batches: Optional[Sequence[torch.Tensor]] = None,
        *,
        routing_sink: Optional[list] = None,
    ) -> torch.Tensor:
        """Per-response-token log-probs ``[sum R_i]`` (fp32, full responses, batch order, CPU) of
        ``model`` at the sampler's temperature: the train step's forward without backward.
        ``routing_sink`` (R2's record pass): receives ``(step token index, experts)`` of every real
        input position whose routing the backend recorded (``MicroBatchInputs.recorded_routing``)."""
        options = ForwardOptions.of(self.cfg, with_entropy=False)
        return self.forward_only(model, batch, micro_batches, options, routing_sink=routing_sink)

    def forward_only(
        self,
        model,
        batch: StepBatch,
        micro_batches: Optional[Sequence[torch.Tensor]],
        options: ForwardOptions,
        *,
        routing_sink: Optional[list] = None,
    ) -> torch.Tensor:
        """Column 0 of ``backend.forward(model, mb, options)`` for every response token, ``[sum
        R_i]`` fp32, full responses (each micro-batch's CP chunks gathered), batch order, on the
        CPU: the log-probs (``log_probs``) or, with ``options.values``, the values (``values``)."""
        backend, cfg, ps = self.backend, self.cfg, self.ps
        batch.validate()
        plan = self.plan(batch, micro_batches)
        rl = batch.response_lengths.long()
        offsets = exclusive_cumsum(rl)
        tl = batch.total_lengths.long()
        token_offsets = exclusive_cumsum(tl)
        device = backend.loss_device
        result = torch.zeros(int(rl.sum()), dtype=torch.float32, device=device)
        pending = {}
        last = ps.is_last_stage

        def forward(i: int) -> torch.Tensor:
            idx = plan[i] if i < len(plan) else _EMPTY
            sub = batch.select(idx)
            inputs = MicroBatchInputs.build(
                sub, cp_rank=ps.cp_rank, cp_size=ps.cp_size, qkv_format=cfg.qkv_format, max_seq_len=cfg.max_seq_len
            )
            if last:
                pending[i] = (idx, sub, inputs)
            return backend.forward(model, inputs, options)

        def loss(i: int, out: torch.Tensor) -> torch.Tensor:
            idx, sub, inputs = pending.pop(i)
            if inputs.layout.num_samples:
                full = gather_micro_batch_responses(
                    out[:, 0].float(), sub, inputs.layout, ps, qkv_format=cfg.qkv_format, max_seq_len=cfg.max_seq_len
                )
                result[expand_runs(offsets[idx], rl[idx]).to(device, non_blocking=True)] = full
                if routing_sink is not None and inputs.recorded_routing is not None:
                    index = inputs.layout.input_index.reshape(-1)
                    valid = index >= 0
                    tokens = expand_runs(token_offsets[idx], tl[idx])  # step token of each micro-batch token
                    routing_sink.append((tokens[index[valid]], inputs.recorded_routing[: index.numel()][valid]))
            return out.new_zeros(())

        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                backend.schedule(model, len(plan), forward, loss, forward_only=True)
        finally:
            model.train(was_training)
        return broadcast_from_last_stage(result, ps).cpu()  # pipeline: the last stage computed it
