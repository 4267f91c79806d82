"""The step's metric names and what each micro-batch records (``StepContext`` calls these).

Per micro-batch (``record_micro_batch``; w_sm = the sample-mean weights, m = the loss mask, so a
w_sm-weighted sum over every micro-batch of every DP x CP rank IS the step's sample mean):

    loss, pg_loss, kl_loss, entropy_loss   the micro-batch's share of J and of its three terms
    pg_clipfrac    SampleMean clipped            ppo_kl       SampleMean (old - logp)
    ratio_mean     SampleMean r                  old_log_prob SampleMean old
    advantage_mean SampleMean A                  entropy      SampleMean H (``with_entropy``)
    ratio_sum      sum_t m r                     ratio_sq_sum sum_t m r^2
    advantage_max / advantage_min over trained tokens,  r = exp(clamped(logp - old))

``--pg-metrics none`` keeps only the four loss terms. ``--loss-type sft_loss`` keeps the four loss
terms and ``sft/nll_sum`` = sum_t m_t (-logp_t) (the ratio and advantage metrics are constants
there); ``with_counts_and_aliases`` turns it into ``sft/tokens`` (the global trained-token count),
``sft/nll`` (the token-mean NLL, whatever the mode) and ``sft/ppl`` = exp(sft/nll). The off-policy sums (``mismatch/*``,
``tis/*``) are recorded by ``off_policy_step``. ``step_metric_names`` fixes the key set every
rank reduces (a rank without a micro-batch still joins with the same keys), ``union_over_group``
does so for the custom TIS function's own names, and ``with_counts_and_aliases`` adds the step's
counts and the aliases (``rollout_log_prob_diff``; DeepSpeed's names with
``--deepspeed-metric-names``).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from rl_plugin.loss.aggregation import weighted_sum
from rl_plugin.loss.counts import StepCounts
from rl_plugin.loss.metrics import MetricAccumulator
from rl_plugin.loss.opd import OPD_SUMS
from rl_plugin.loss.policy import clamped_log_ratio
from rl_plugin.loss_config import LossConfig

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


def record_micro_batch(
    acc: MetricAccumulator,
    cfg: LossConfig,
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
) -> None:
    """Add one micro-batch's loss terms and ``--pg-metrics`` sums to ``acc`` (module docstring)."""
    acc.add("loss", objective)
    acc.add("pg_loss", pg_term)
    acc.add("kl_loss", kl_term if kl_term is not None else objective.new_zeros(()))
    acc.add("entropy_loss", entropy_term if entropy_term is not None else objective.new_zeros(()))
    if cfg.is_sft:
        with torch.no_grad():
            acc.add("sft/nll_sum", weighted_sum(-log_probs, mask))
        return
    if cfg.pg_metrics == "none":
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
        if cfg.pg_metrics == "with_entropy" and entropy is not None:
            acc.add("entropy", weighted_sum(entropy.to(w_sm.dtype), w_sm))


def step_metric_names(
    cfg: LossConfig, measure_mismatch: bool, custom_tis_names: Sequence[str] = ()
) -> Tuple[List[str], List[str], List[str]]:
    """``(sums, maxes, mins)``: the names every rank reduces at the end of the step."""
    names_sum: List[str] = list(LOSS_TERMS)
    names_max, names_min = [], []
    if cfg.is_sft:
        names_sum.append("sft/nll_sum")
    elif cfg.pg_metrics != "none":
        names_sum += list(SUM_METRICS_BASIC)
        names_max, names_min = ["advantage_max"], ["advantage_min"]
        if cfg.pg_metrics == "with_entropy":
            names_sum.append("entropy")
    if measure_mismatch:
        names_sum += list(MISMATCH_SUMS)
        names_max.append("mismatch/abs_diff_max")
        if cfg.use_tis and cfg.custom_tis_function is None:
            names_sum += list(TIS_SUMS)
    names_sum += list(custom_tis_names)
    if cfg.use_opd:
        names_sum += list(OPD_SUMS)
    return names_sum, names_max, names_min


def union_over_group(names: Sequence[str], group) -> List[str]:
    """The sorted union of ``names`` over ``group`` (None: this rank's alone). A rank without a
    micro-batch never called the custom TIS function, so the names are gathered (collective)."""
    import torch.distributed as dist

    if group is None:  # DP x CP = 1
        return sorted(names)
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, sorted(names), group=group)
    return sorted({n for per_rank in gathered for n in per_rank})


def with_counts_and_aliases(
    out: Dict[str, Optional[float]], cfg: LossConfig, counts: StepCounts, measure_mismatch: bool
) -> Dict[str, Optional[float]]:
    """The reduced metrics plus the step's counts and the aliases of other names (in place)."""
    out["samples"] = float(counts.num_samples)
    out["tokens"] = float(counts.total_tokens)
    out["groups"] = float(counts.num_groups)
    if cfg.is_sft:
        tokens = float(counts.total_tokens)
        out["sft/tokens"] = tokens
        out["sft/nll"] = out.pop("sft/nll_sum") / tokens if tokens > 0 else 0.0
        out["sft/ppl"] = math.exp(min(out["sft/nll"], 700.0))  # exp(700) is still a finite double
    if measure_mismatch:
        out["rollout_log_prob_diff"] = out["mismatch/abs_diff_mean"]  # the name of earlier releases
    if cfg.deepspeed_metric_names and cfg.pg_metrics != "none" and not cfg.is_sft:
        out.update({ds: out[ours] for ds, ours in DEEPSPEED_NAMES.items() if ours in out})
    return out
