"""One optimizer step on the shared loss core (``runner.StepRunner`` drives it for both backends).

    ctx = prepare_step(batch, cfg, ps, device=d)  # validate, global counts (one all-reduce),
                                                  # per-token weights, built ONCE per step and
                                                  # moved to the loss device d ONCE
    for idx in micro_batch_sample_indices:
        mb = ctx.micro_batch(idx)                 # CP-local inputs, targets, sliced tensors
        logp, ent = fused_log_probs_and_entropy(hidden_rows, weight_shard, mb.targets, ...)
                                                  # or log_probs_and_entropy(logits rows, ...)
        out = ctx.loss(logp, ent, mb)             # this micro-batch's share of J
        (out.objective * backend_scale).backward()
    report = ctx.finish()                         # J, pg/kl/entropy terms, metrics (2 all-reduces)

The step objective (DESIGN.md) is

    J = J_pg(mode) + kl_coef * SampleMean(kl) - entropy_coef * SampleMean(entropy)

with J_pg aggregated by ``--loss-aggregation`` (or the custom reducer) and the KL / entropy terms
kept as sample means so they compare across runs (``objective.py``). With ``--use-tis`` the
per-token policy loss is multiplied by the detached off-policy weight (``off_policy_step.py``)
before aggregation. The metrics each micro-batch records and their names: ``step_metrics.py``.
``out.objective`` summed over every micro-batch of every DP x CP rank is exactly J (J / N with
``--deepspeed-grad-scale``, whose reported loss stays J); each backend multiplies it by the
factor that cancels its own averaging (Megatron: num_microbatches x dp_cp_size; FSDP: dp_size) so the applied gradient is
exactly dJ/dtheta.

``old_from_forward=True`` (``runner.py``, "no redundant forward"): the step's old log-probs are
the detached log-probs of this very forward (the rollout is trained in one optimizer step on the
weights that would have produced them). The ratio is then computed against ``log_probs.detach()``
exactly as with ``old_log_probs=None``; the TIS weights are built per micro-batch from the same
detached values, and the mismatch metrics from the assembled step's old log-probs at ``finish``,
so every number equals the separate-pass path's.

This module owns the step's state and its slicing: ``StepContext`` moves the step's per-token
tensors to the loss device once and ``micro_batch`` cuts a micro-batch out of them with one index
tensor; ``loss`` and ``finish`` assemble the terms of the modules above.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from rl_plugin.cp import exclusive_cumsum, expand_runs
from rl_plugin.loss.aggregation import token_weights, weighted_sum
from rl_plugin.loss.backend_api import MicroBatch, MicroBatchInputs
from rl_plugin.loss.batch import StepBatch
from rl_plugin.loss.comm import gather_micro_batch_responses
from rl_plugin.loss.counts import StepCounts, compute_step_counts
from rl_plugin.loss.metrics import MetricAccumulator
from rl_plugin.loss.objective import MicroBatchLoss, custom_pg_term, kl_and_entropy_terms
from rl_plugin.loss.off_policy_step import (
    check_old_from_forward,
    custom_tis,
    forward_tis_weights,
    off_policy_weights,
)
from rl_plugin.loss.opd import opd_advantages, record_opd_metrics
from rl_plugin.loss.policy import get_policy_loss
from rl_plugin.loss.step_metrics import (
    record_micro_batch,
    step_metric_names,
    union_over_group,
    with_counts_and_aliases,
)
from rl_plugin.loss.worst_token import ACTOR_REF_KEYS, reduce_worst, worst_token
from rl_plugin.loss_config import LossConfig
from rl_plugin.parallel import ParallelState


def _to(t: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    return None if t is None else t.to(device, non_blocking=True)


class StepContext:
    """The step's per-token tensors on the loss device (``device``): moved there once, here.

    ``loss_mask``, ``advantages``, ``old/ref/rollout_log_probs``, the two weight vectors, the TIS
    weights and M_i live on ``device`` for the whole step; a micro-batch takes its slice with one
    index tensor (``micro_batch``). The counts and weights are built on the CPU from the CPU
    batch (their collective carries CPU scalars), then moved; the off-policy terms are built on
    ``device`` so both ways of getting old log-probs compute them on the same hardware."""

    def __init__(
        self,
        batch: StepBatch,
        cfg: LossConfig,
        ps: ParallelState,
        counts: StepCounts,
        device: Optional[torch.device] = None,
        old_from_forward: bool = False,
    ):
        self.batch, self.cfg, self.ps, self.counts = batch, cfg, ps, counts
        self.device = device = torch.device("cpu") if device is None else torch.device(device)
        pg_weights = token_weights(
            cfg.loss_aggregation,
            counts,
            batch.loss_mask,
            batch.response_lengths,
            batch.group_ids,
            cfg.loss_aggregation_divisor,
        )
        sm_weights = token_weights("sample_mean", counts, batch.loss_mask, batch.response_lengths, batch.group_ids)
        self.pg_weights, self.sample_mean_weights = _to(pg_weights, device), _to(sm_weights, device)
        self.loss_mask, self.advantages = _to(batch.loss_mask, device), _to(batch.advantages, device)
        self.old_log_probs, self.ref_log_probs = _to(batch.old_log_probs, device), _to(batch.ref_log_probs, device)
        self.rollout_log_probs = _to(batch.rollout_log_probs, device)
        self.sample_tokens = _to(counts.sample_tokens, device)
        self._resp_offsets = exclusive_cumsum(batch.response_lengths.long())
        self.metrics = MetricAccumulator(device)
        if cfg.use_opd:  # on-policy distillation: the advantages shifted once per step (loss/opd.py)
            self.advantages = self._opd_advantages(batch, counts)
        self.policy_loss = get_policy_loss("sft_nll" if cfg.is_sft else cfg.policy_loss)
        self.custom_tis_names: List[str] = []
        self.worst: Optional[torch.Tensor] = None  # --ci-test: this rank's worst token (``worst_token``)
        self.grad_scale = 1.0 / counts.num_samples if cfg.deepspeed_grad_scale else 1.0
        self.old_from_forward = old_from_forward
        if old_from_forward:
            self.measure_mismatch = check_old_from_forward(batch, cfg, ps.cp_size)
            # The detached training log-probs of every response token, for the mismatch metrics.
            self.forward_old = (
                torch.zeros(batch.loss_mask.shape[0], dtype=torch.float32, device=device)
                if self.measure_mismatch
                else None
            )
            self.tis_weights = None  # built per micro-batch (loss)
        else:
            self.tis_weights = self._off_policy_weights(self.old_log_probs)

    def _opd_advantages(self, batch: StepBatch, counts: StepCounts) -> torch.Tensor:
        """``--use-opd``: A - coef * m * (old - teacher) on the loss device, and its metrics."""
        if self.old_log_probs is None or batch.teacher_log_probs is None:
            missing = "old_log_probs (a separate old pass)" if self.old_log_probs is None else "teacher_log_probs"
            raise ValueError(
                f"--use-opd needs the student's old and the teacher's log-probs; the step batch has no {missing}"
            )
        teacher = _to(batch.teacher_log_probs, self.device)
        record_opd_metrics(
            self.metrics, self.old_log_probs, teacher, self.loss_mask, float(counts.total_tokens), self.ps.cp_rank
        )
        return opd_advantages(self.advantages, self.old_log_probs, teacher, self.loss_mask, self.cfg.opd_kl_coef)

    def _off_policy_weights(self, old: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """TIS weights of this rank's full responses (or None), and the mismatch metrics."""
        w, self.measure_mismatch = off_policy_weights(
            old,
            self.rollout_log_probs,
            self.loss_mask,
            self.batch.response_lengths,
            self.sample_mean_weights,
            self.cfg,
            self.metrics,
            self.ps.cp_rank,
        )
        if self.cfg.report_worst_token and self.measure_mismatch:
            b = self.batch
            self.worst = worst_token(old, self.rollout_log_probs, self.loss_mask, b.response_lengths, b.sample_index)
        return w

    # -- micro-batches ----------------------------------------------------------------------
    def micro_batch(self, sample_index) -> MicroBatch:
        sample_index = torch.as_tensor(sample_index, dtype=torch.long).reshape(-1)
        sub = self.batch.select(sample_index)
        inputs = MicroBatchInputs.build(
            sub,
            cp_rank=self.ps.cp_rank,
            cp_size=self.ps.cp_size,
            qkv_format=self.cfg.qkv_format,
            max_seq_len=self.cfg.max_seq_len,
        )
        layout = inputs.layout
        step_resp = expand_runs(self._resp_offsets[sample_index], self.batch.response_lengths.long()[sample_index])
        # Step-level response index of each local token: the ONE index moved to the loss device
        # per micro-batch; every per-token field is a gather of a step tensor already there.
        local = step_resp[layout.resp_index].to(self.device, non_blocking=True)
        return MicroBatch(
            sample_index=sample_index,
            batch=sub,
            layout=layout,
            input_ids=inputs.input_ids,
            position_ids=inputs.position_ids,
            targets=inputs.targets,
            loss_mask=self.loss_mask[local],
            advantages=self.advantages[local],
            old_log_probs=None if self.old_log_probs is None else self.old_log_probs[local],
            ref_log_probs=None if self.ref_log_probs is None else self.ref_log_probs[local],
            pg_weights=self.pg_weights[local],
            sample_mean_weights=self.sample_mean_weights[local],
            sample_token_counts=self.sample_tokens[sample_index.to(self.device, non_blocking=True)],
            tis_weights=None if self.tis_weights is None else self.tis_weights[local],
            step_token_index=step_resp,
            local_index=local,
            sample_ids=layout.sample_ids.to(self.device, non_blocking=True),
            routed_experts=inputs.routed_experts,
        )

    # -- the loss -------------------------------------------------------------------------
    def loss(self, log_probs: torch.Tensor, entropy: Optional[torch.Tensor], mb: MicroBatch) -> MicroBatchLoss:
        """This micro-batch's share of J from its CP-local log-probs (and entropy)."""
        cfg = self.cfg
        if log_probs.shape[0] != mb.num_local_tokens:
            raise ValueError(
                f"log_probs has {log_probs.shape[0]} rows, the micro-batch has {mb.num_local_tokens} local response tokens"
            )
        dtype = log_probs.dtype
        mask = mb.loss_mask.to(dtype)
        w_pg = mb.pg_weights.to(dtype)
        w_sm = mb.sample_mean_weights.to(dtype)
        # On-policy with no stored old log-probs (or old_from_forward): the ratio is exactly 1
        # (value), grad flows.
        old = log_probs.detach() if mb.old_log_probs is None else mb.old_log_probs.to(dtype)
        adv = mb.advantages.to(dtype)
        pg_tok, clipped = self.policy_loss(
            log_probs,
            old,
            adv,
            loss_mask=mb.loss_mask,
            eps_clip=cfg.eps_clip,
            eps_clip_high=cfg.eps_clip_high,
            eps_clip_c=cfg.eps_clip_c,
            sample_ids=mb.sample_ids,
            num_samples=mb.layout.num_samples,
            sample_token_counts=mb.sample_token_counts,
            cp_group=self.ps.cp_group,
        )
        if self.old_from_forward and self.measure_mismatch:
            self.forward_old[mb.local_index] = old.float()  # what the separate pass would store
            if cfg.use_tis:
                mb.tis_weights = forward_tis_weights(
                    self.forward_old[mb.local_index],
                    self.rollout_log_probs[mb.local_index],
                    mb.loss_mask,
                    mb.batch.response_lengths,
                    cfg,
                )
        if mb.tis_weights is not None:
            pg_tok = pg_tok * mb.tis_weights.to(dtype)  # detached: a constant of the step
        elif cfg.use_tis:
            pg_tok = self._custom_tis(pg_tok, mb)
        if cfg.custom_pg_reducer is not None:
            pg_term = custom_pg_term(
                self._gather_full(pg_tok, mb),
                mb.batch,
                self.loss_mask[mb.step_token_index.to(self.device)],
                cfg,
                self.counts,
                self.ps.cp_size,
            )
        else:
            pg_term = weighted_sum(pg_tok, w_pg)
        objective, kl_term, entropy_term = kl_and_entropy_terms(
            pg_term, log_probs, entropy, mb.ref_log_probs, mask, w_sm, cfg
        )
        record_micro_batch(
            self.metrics,
            cfg,
            objective,
            pg_term,
            kl_term,
            entropy_term,
            log_probs,
            old,
            adv,
            mask,
            clipped,
            entropy,
            w_sm,
        )
        if self.grad_scale != 1.0:
            objective = objective * self.grad_scale  # recorded (reported) unscaled, above
        return MicroBatchLoss(objective=objective)

    def _gather_full(self, x_local: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """The micro-batch's FULL responses of a CP-local per-token tensor (differentiable)."""
        return gather_micro_batch_responses(
            x_local, mb.batch, mb.layout, self.ps, qkv_format=self.cfg.qkv_format, max_seq_len=self.cfg.max_seq_len
        )

    def _custom_tis(self, pg_tok: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """``off_policy_step.custom_tis`` on the micro-batch's FULL responses, sliced back."""
        return custom_tis(
            self._gather_full(pg_tok, mb),
            mb.batch,
            mb.layout.resp_index,
            mb.step_token_index.to(self.device, non_blocking=True),
            (self.old_log_probs, self.rollout_log_probs, self.loss_mask, self.sample_mean_weights),
            self.cfg,
            self.metrics,
            self.custom_tis_names,
            self.ps.cp_rank,
        )

    # -- end of step ------------------------------------------------------------------------
    def finish(self) -> Dict[str, Optional[float]]:
        """J and the metrics for the step; collective over DP x CP (call on every rank)."""
        cfg = self.cfg
        if self.old_from_forward and self.measure_mismatch:
            # The mismatch / TIS metrics of the assembled old log-probs: the same function of the
            # same values as the separate pass's (``_off_policy_weights`` at prepare time).
            self._off_policy_weights(self.forward_old)
        custom_names = (
            union_over_group(self.custom_tis_names, self.ps.dp_cp_group)
            if cfg.use_tis and cfg.custom_tis_function is not None
            else []
        )
        names_sum, names_max, names_min = step_metric_names(cfg, self.measure_mismatch, custom_names)
        out = self.metrics.reduce(self.ps, names_sum, names_max, names_min)
        if cfg.report_worst_token and self.measure_mismatch:
            out.update(reduce_worst(self.worst, self.ps.dp_cp_group))
        old = self.forward_old if self.old_from_forward else self.old_log_probs
        if cfg.report_actor_ref and self.ref_log_probs is not None and old is not None:  # --ci-test: actor = ref
            b = self.batch
            worst = worst_token(old, self.ref_log_probs, self.loss_mask, b.response_lengths, b.sample_index)
            out.update(reduce_worst(worst, self.ps.dp_cp_group, ACTOR_REF_KEYS))
        return with_counts_and_aliases(out, cfg, self.counts, self.measure_mismatch)


def prepare_step(
    batch: StepBatch,
    cfg: LossConfig,
    ps: ParallelState,
    *,
    num_groups: Optional[int] = None,
    device: Optional[torch.device] = None,
    old_from_forward: bool = False,
) -> StepContext:
    """Validate this rank's step data, compute the global counts once, build the weights and
    move the step's per-token tensors to the loss ``device`` (default CPU) once."""
    batch.validate()
    counts = compute_step_counts(batch, ps, num_groups)
    return StepContext(batch, cfg, ps, counts, device=device, old_from_forward=old_from_forward)
