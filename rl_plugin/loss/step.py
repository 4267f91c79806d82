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
kept as sample means so they compare across runs. With ``--use-tis`` the per-token policy loss is
multiplied by the detached off-policy weight (``offpolicy.py``) before aggregation.
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from rl_plugin.cp import exclusive_cumsum, expand_runs
from rl_plugin.loss.aggregation import token_weights, weighted_sum
from rl_plugin.loss.backend_api import MicroBatch, MicroBatchInputs
from rl_plugin.loss.batch import StepBatch
from rl_plugin.loss.comm import gather_micro_batch_responses
from rl_plugin.loss.config import LossConfig
from rl_plugin.loss.counts import StepCounts, compute_step_counts
from rl_plugin.loss.errors import BadBatchError
from rl_plugin.loss.kl import kl_estimate
from rl_plugin.loss.metrics import MetricAccumulator
from rl_plugin.loss.offpolicy import mismatch_terms, tis_weights_and_flags
from rl_plugin.loss.policy import clamped_log_ratio, get_policy_loss
from rl_plugin.parallel import ParallelState

SUM_METRICS_BASIC = (
    "pg_clipfrac",
    "ppo_kl",
    "ratio_mean",
    "old_log_prob",
    "advantage_mean",
    "ratio_sum",
    "ratio_sq_sum",
)
LOSS_TERMS = ("loss", "pg_loss", "kl_loss", "entropy_loss")
MISMATCH_SUMS = ("mismatch/abs_diff_mean", "mismatch/k3_kl")
TIS_SUMS = ("tis/weight_mean", "tis/clipped_frac")
# DeepSpeed's names for the same quantities (--deepspeed-metric-names), logged besides ours.
DEEPSPEED_NAMES = {
    "ratio_new_old": "ratio_mean",
    "ratio_new_old_sum": "ratio_sum",
    "ratio_new_old_squared_sum": "ratio_sq_sum",
    "kl_new_old": "ppo_kl",
    "clipped_ratio_fraction": "pg_clipfrac",
    "advantage": "advantage_mean",
    "max_advantage": "advantage_max",
    "min_advantage": "advantage_min",
    "num_tokens": "tokens",
    "entropy": "entropy",
    "old_logprobs": "old_log_prob",
}


@dataclass
class MicroBatchLoss:
    """``objective``: this micro-batch's share of J (differentiable)."""

    objective: torch.Tensor


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
        mode = "token_mean" if cfg.calculate_per_token_loss else cfg.loss_aggregation
        pg_weights = token_weights(
            mode, counts, batch.loss_mask, batch.response_lengths, batch.group_ids, cfg.loss_aggregation_divisor
        )
        sm_weights = token_weights("sample_mean", counts, batch.loss_mask, batch.response_lengths, batch.group_ids)
        self.pg_weights, self.sample_mean_weights = _to(pg_weights, device), _to(sm_weights, device)
        self.loss_mask, self.advantages = _to(batch.loss_mask, device), _to(batch.advantages, device)
        self.old_log_probs, self.ref_log_probs = _to(batch.old_log_probs, device), _to(batch.ref_log_probs, device)
        self.rollout_log_probs = _to(batch.rollout_log_probs, device)
        self.sample_tokens = _to(counts.sample_tokens, device)
        self._resp_offsets = exclusive_cumsum(batch.response_lengths.long())
        self.metrics = MetricAccumulator(device)
        self.policy_loss = get_policy_loss(cfg.policy_loss)
        self.custom_tis_names: List[str] = []
        self.grad_scale = 1.0 / counts.num_samples if cfg.deepspeed_grad_scale else 1.0
        self.old_from_forward = old_from_forward
        if old_from_forward:
            self._check_old_from_forward()
            # The detached training log-probs of every response token, for the mismatch metrics.
            self.forward_old = (
                torch.zeros(batch.loss_mask.shape[0], dtype=torch.float32, device=device)
                if self.measure_mismatch
                else None
            )
            self.tis_weights = None  # built per micro-batch (loss)
        else:
            self.tis_weights = self._off_policy_weights(self.old_log_probs)

    # -- off-policy weights and mismatch metrics, once per step -------------------------------
    def _check_old_from_forward(self) -> None:
        b, cfg = self.batch, self.cfg
        self.measure_mismatch = b.rollout_log_probs is not None
        if b.old_log_probs is not None:
            raise ValueError("old_from_forward: the step batch already carries old_log_probs")
        if cfg.use_tis and b.rollout_log_probs is None:
            raise BadBatchError("--use-tis needs the rollout log-probs (the engine's); the step batch has none")
        why = old_from_forward_unsupported(cfg, self.ps.cp_size, self.measure_mismatch)
        if why is not None:
            raise ValueError(f"old_from_forward: {why}; compute old log-probs in a separate pass")

    def _off_policy_weights(self, old: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """TIS weights of this rank's full responses (or None), and the mismatch metrics. Every
        CP rank holds the same full responses, so only CP rank 0 adds to the (DP x CP) sums."""
        b, cfg = self.batch, self.cfg
        has_both = old is not None and b.rollout_log_probs is not None
        if cfg.use_tis and not has_both:
            missing = (
                "rollout_log_probs (the engine's)" if b.rollout_log_probs is None else "old_log_probs (the trainer's)"
            )
            raise BadBatchError(f"--use-tis needs both old and rollout log-probs; the step batch has no {missing}")
        self.measure_mismatch = has_both
        if not has_both:
            return None
        rollout, mask = self.rollout_log_probs, self.loss_mask
        terms = mismatch_terms(old, rollout, mask)
        w = flags = None
        if cfg.use_tis and cfg.custom_tis_function is None:
            w, flags = tis_weights_and_flags(
                old,
                rollout,
                mask,
                b.response_lengths,
                level=cfg.tis_level,
                mode=cfg.tis_mode,
                clip_low=cfg.tis_clip_low,
                clip_high=cfg.tis_clip,
            )
        acc, w_sm = self.metrics, self.sample_mean_weights
        if self.ps.cp_rank == 0:
            acc.add("mismatch/abs_diff_mean", (terms["abs_diff"] * w_sm).sum())
            acc.add("mismatch/k3_kl", (terms["k3_kl"] * w_sm).sum())
            if w is not None:
                acc.add("tis/weight_mean", (w * w_sm).sum())
                acc.add("tis/clipped_frac", (flags * w_sm).sum())
        abs_diff = terms["abs_diff"]
        acc.add_max("mismatch/abs_diff_max", torch.where(mask > 0, abs_diff, abs_diff.new_full((), -math.inf)))
        return w

    def _forward_tis_weights(self, old: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """``old_from_forward``: the TIS weights of the micro-batch's responses from its detached
        log-probs. At CP = 1 its local tokens are its full responses in order, so the token and
        sequence weights are the per-sample functions the whole-step pass computes."""
        cfg = self.cfg
        w, _ = tis_weights_and_flags(
            old,
            self.rollout_log_probs[mb.local_index],
            mb.loss_mask,
            mb.batch.response_lengths,
            level=cfg.tis_level,
            mode=cfg.tis_mode,
            clip_low=cfg.tis_clip_low,
            clip_high=cfg.tis_clip,
        )
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
                mb.tis_weights = self._forward_tis_weights(self.forward_old[mb.local_index], mb)
        if mb.tis_weights is not None:
            pg_tok = pg_tok * mb.tis_weights.to(dtype)  # detached: a constant of the step
        elif cfg.use_tis:
            pg_tok = self._custom_tis(pg_tok, mb)
        if cfg.custom_pg_reducer is not None:
            pg_term = self._custom_pg_term(pg_tok, mb)
        else:
            pg_term = weighted_sum(pg_tok, w_pg)
        objective = pg_term
        kl_term = entropy_term = None
        if cfg.use_kl_loss:
            if mb.ref_log_probs is None:
                raise ValueError("--use-kl-loss needs ref_log_probs in the batch (a reference forward pass)")
            ref_lp = mb.ref_log_probs.to(dtype)
            # a masked token's log-prob is replaced by the reference's BEFORE the nonlinear
            # estimator, so neither its value nor its gradient (0 * inf) can be non-finite
            kl_term = weighted_sum(
                kl_estimate(torch.where(mask != 0, log_probs, ref_lp), ref_lp, cfg.kl_loss_type), w_sm
            )
            objective = objective + cfg.kl_loss_coef * kl_term
        if cfg.entropy_coef != 0.0:
            if entropy is None:
                raise ValueError("--entropy-coef != 0 needs the entropy from log_probs_and_entropy")
            entropy_term = weighted_sum(entropy.to(dtype), w_sm)
            objective = objective - cfg.entropy_coef * entropy_term
        self._record(objective, pg_term, kl_term, entropy_term, log_probs, old, adv, mask, clipped, entropy, w_sm)
        if self.grad_scale != 1.0:
            objective = objective * self.grad_scale  # recorded (reported) unscaled, above
        return MicroBatchLoss(objective=objective)

    def _gather_full(self, x_local: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """The micro-batch's FULL responses of a CP-local per-token tensor (differentiable)."""
        return gather_micro_batch_responses(
            x_local, mb.batch, mb.layout, self.ps, qkv_format=self.cfg.qkv_format, max_seq_len=self.cfg.max_seq_len
        )

    def _custom_tis(self, pg_tok: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """slime's ``--custom-tis-function-path`` hook on the micro-batch's FULL responses
        (``offpolicy.load_custom_tis_function``), then this rank's CP slice of its result. The
        returned loss masks multiply the loss; the step's denominators stay global."""
        full = self._gather_full(pg_tok, mb)
        b, dtype = mb.batch, pg_tok.dtype
        split = b.response_lengths.long().tolist()
        idx = mb.step_token_index.to(self.device, non_blocking=True)
        out, masks, metrics = self.cfg.custom_tis_function(
            self.cfg,
            pg_loss=full,
            train_log_probs=list(self.old_log_probs[idx].to(dtype).split(split)),
            rollout_log_probs=list(self.rollout_log_probs[idx].to(dtype).split(split)),
            loss_masks=list(self.loss_mask[idx].split(split)),
            total_lengths=b.total_lengths.tolist(),
            response_lengths=split,
        )
        if out.shape != full.shape:
            raise ValueError(
                f"--custom-tis-function-path returned pg_loss of shape {tuple(out.shape)}, expected {tuple(full.shape)}"
            )
        new_mask = (
            torch.cat([torch.as_tensor(x) for x in masks]).to(full.device, dtype) if len(masks) else full.new_zeros(0)
        )
        if self.ps.cp_rank == 0:
            w_sm = self.sample_mean_weights[idx]
            for name, value in (metrics or {}).items():
                key = f"tis/{name}"
                if key not in self.custom_tis_names:
                    self.custom_tis_names.append(key)
                self.metrics.add(key, (value.detach().to(torch.float64).reshape(-1) * w_sm).sum())
        return (out * new_mask)[mb.layout.resp_index]

    def _custom_pg_term(self, pg_tok: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """miles-compatible hook: ``factory(total_lengths, response_lengths, loss_masks,
        calculate_per_token_loss)`` returns ``reducer(x) -> scalar`` over the micro-batch's FULL
        responses (gathered over CP, so the user never sees chunks). Its value is a sum over the
        micro-batch, normalised here by the global N (or global tokens in per-token mode); each CP
        rank holds the same value, so it is divided by cp_size."""
        full = self._gather_full(pg_tok, mb)
        rl = mb.batch.response_lengths.long()
        loss_masks = list(self.loss_mask[mb.step_token_index.to(self.device)].split(rl.tolist()))
        reducer = self.cfg.custom_pg_reducer(
            mb.batch.total_lengths.tolist(), rl.tolist(), loss_masks, self.cfg.calculate_per_token_loss
        )
        denom = (
            (self.counts.total_tokens or 1.0) if self.cfg.calculate_per_token_loss else float(self.counts.num_samples)
        )
        return reducer(full) / (denom * self.ps.cp_size)

    def _record(self, objective, pg_term, kl_term, entropy_term, log_probs, old, adv, mask, clipped, entropy, w_sm):
        acc = self.metrics
        acc.add("loss", objective)
        acc.add("pg_loss", pg_term)
        acc.add("kl_loss", kl_term if kl_term is not None else objective.new_zeros(()))
        acc.add("entropy_loss", entropy_term if entropy_term is not None else objective.new_zeros(()))
        if self.cfg.pg_metrics == "none":
            return
        with torch.no_grad():
            ratio = torch.exp(clamped_log_ratio(log_probs, old))  # the ratio the loss used
            acc.add("pg_clipfrac", weighted_sum(clipped, w_sm))
            acc.add("ppo_kl", weighted_sum(old - log_probs, w_sm))
            acc.add("ratio_mean", weighted_sum(ratio, w_sm))
            acc.add("old_log_prob", weighted_sum(old, w_sm))
            acc.add("advantage_mean", weighted_sum(adv, w_sm))
            acc.add("ratio_sum", weighted_sum(ratio, mask))
            acc.add("ratio_sq_sum", weighted_sum(ratio * ratio, mask))
            valid = mask > 0  # masked, not indexed: no host sync on an accelerator
            acc.add_max("advantage_max", torch.where(valid, adv, adv.new_full((), -math.inf)))
            acc.add_min("advantage_min", torch.where(valid, adv, adv.new_full((), math.inf)))
            if self.cfg.pg_metrics == "with_entropy" and entropy is not None:
                acc.add("entropy", weighted_sum(entropy.to(w_sm.dtype), w_sm))

    # -- end of step ------------------------------------------------------------------------
    def finish(self) -> Dict[str, Optional[float]]:
        """J and the metrics for the step; collective over DP x CP (call on every rank)."""
        if self.old_from_forward and self.measure_mismatch:
            # The mismatch / TIS metrics of the assembled old log-probs: the same function of the
            # same values as the separate pass's (``_off_policy_weights`` at prepare time).
            self._off_policy_weights(self.forward_old)
        names_sum: List[str] = list(LOSS_TERMS)
        names_max, names_min = [], []
        if self.cfg.pg_metrics != "none":
            names_sum += list(SUM_METRICS_BASIC)
            names_max, names_min = ["advantage_max"], ["advantage_min"]
            if self.cfg.pg_metrics == "with_entropy":
                names_sum.append("entropy")
        if self.measure_mismatch:
            names_sum += list(MISMATCH_SUMS)
            names_max.append("mismatch/abs_diff_max")
            if self.cfg.use_tis and self.cfg.custom_tis_function is None:
                names_sum += list(TIS_SUMS)
        if self.cfg.use_tis and self.cfg.custom_tis_function is not None:
            names_sum += self._all_custom_tis_names()
        out = self.metrics.reduce(self.ps, names_sum, names_max, names_min)
        out["samples"] = float(self.counts.num_samples)
        out["tokens"] = float(self.counts.total_tokens)
        out["groups"] = float(self.counts.num_groups)
        if self.measure_mismatch:
            out["rollout_log_prob_diff"] = out["mismatch/abs_diff_mean"]  # the name of earlier releases
        if self.cfg.deepspeed_metric_names and self.cfg.pg_metrics != "none":
            out.update({ds: out[ours] for ds, ours in DEEPSPEED_NAMES.items() if ours in out})
        return out

    def _all_custom_tis_names(self) -> List[str]:
        """The union of the custom TIS function's metric names over DP x CP (a rank without a
        micro-batch never called it), so every rank joins the reduction with the same keys."""
        import torch.distributed as dist

        group = self.ps.dp_cp_group
        if group is None:  # DP x CP = 1
            return sorted(self.custom_tis_names)
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, sorted(self.custom_tis_names), group=group)
        return sorted({n for names in gathered for n in names})


def old_from_forward_unsupported(cfg: LossConfig, cp_size: int, has_rollout_log_probs: bool) -> Optional[str]:
    """Why the old log-probs cannot be taken from the training forward with the same numbers as
    a separate pass (None: they can). The step-level conditions (one optimizer step per rollout,
    same weights, deterministic forward) are the caller's (``runner.old_log_probs_rule``)."""
    if cfg.use_tis and cfg.custom_tis_function is not None:
        return "--custom-tis-function-path reads the full old log-probs before the loss"
    if cp_size > 1 and has_rollout_log_probs:
        return (
            "context parallelism: the mismatch metrics and sequence-level TIS weights need every CP chunk's "
            "old log-probs of a response"
        )
    return None


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
