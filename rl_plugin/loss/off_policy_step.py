"""The step's off-policy terms (``StepContext`` calls these), on the loss device.

Per response token, d_t = old_t - rollout_t (the trainer's old log-prob minus the engine's); the
formulas of the weight w and of the metrics are in ``offpolicy.py``. Here, for one step:

- ``off_policy_weights``: with both log-probs present, the TIS weights w of this rank's FULL
  responses (``--use-tis``, built-in levels and modes) and the mismatch / TIS metric sums,
  SampleMean |d|, SampleMean k3(d), SampleMean w, SampleMean [clipped], and max |d| over trained
  tokens. Every CP rank holds the same full responses, so only CP rank 0 adds to the sums.
  ``--use-tis`` without both log-probs is a ``BadBatchError``.
- ``custom_tis``: ``--custom-tis-function-path`` on one micro-batch's FULL responses; its loss
  masks multiply the per-token loss, the step's denominators stay global.

Two ways to get the old log-probs, with the same numbers:

- a separate forward pass (old log-probs in the batch): ``off_policy_weights`` once, when the
  step is prepared; a micro-batch slices w like any per-token field.
- ``old_from_forward`` (``check_old_from_forward`` says when it applies): the old log-probs are
  the training forward's detached log-probs. ``forward_tis_weights`` builds each micro-batch's w
  from them (CP = 1, so its local tokens are its full responses, in order), and
  ``off_policy_weights`` runs at ``finish`` on the assembled values for the metrics.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

import torch

from rl_plugin.loss.batch import StepBatch
from rl_plugin.loss.errors import BadBatchError
from rl_plugin.loss.metrics import MetricAccumulator
from rl_plugin.loss.offpolicy import mismatch_terms, tis_weights_and_flags
from rl_plugin.loss_config import LossConfig


def old_from_forward_unsupported(cfg: LossConfig, cp_size: int, has_rollout_log_probs: bool) -> Optional[str]:
    """Why the old log-probs cannot be taken from the training forward with the same numbers as
    a separate pass (None: they can). The step-level conditions (one optimizer step per rollout,
    same weights, deterministic forward) are the caller's (``runner.old_log_probs_rule``)."""
    if cfg.use_tis and cfg.custom_tis_function is not None:
        return "--custom-tis-function-path reads the full old log-probs before the loss"
    if cfg.use_opd:
        return "--use-opd shifts the advantages by the old log-probs before the step"
    if cp_size > 1 and has_rollout_log_probs:
        return (
            "context parallelism: the mismatch metrics and sequence-level TIS weights need every CP chunk's "
            "old log-probs of a response"
        )
    return None


def check_old_from_forward(batch: StepBatch, cfg: LossConfig, cp_size: int) -> bool:
    """Raise unless ``old_from_forward`` gives the separate pass's numbers for this step; returns
    whether the mismatch metrics are measured (the batch has rollout log-probs)."""
    measure_mismatch = batch.rollout_log_probs is not None
    if batch.old_log_probs is not None:
        raise ValueError("old_from_forward: the step batch already carries old_log_probs")
    if cfg.use_tis and batch.rollout_log_probs is None:
        raise BadBatchError("--use-tis needs the rollout log-probs (the engine's); the step batch has none")
    why = old_from_forward_unsupported(cfg, cp_size, measure_mismatch)
    if why is not None:
        raise ValueError(f"old_from_forward: {why}; compute old log-probs in a separate pass")
    return measure_mismatch


def _tis(cfg: LossConfig, old, rollout, mask, response_lengths):
    return tis_weights_and_flags(
        old,
        rollout,
        mask,
        response_lengths,
        level=cfg.tis_level,
        mode=cfg.tis_mode,
        clip_low=cfg.tis_clip_low,
        clip_high=cfg.tis_clip,
    )


def off_policy_weights(
    old: Optional[torch.Tensor],
    rollout: Optional[torch.Tensor],
    loss_mask: torch.Tensor,
    response_lengths: torch.Tensor,
    sample_mean_weights: torch.Tensor,
    cfg: LossConfig,
    metrics: MetricAccumulator,
    cp_rank: int,
) -> Tuple[Optional[torch.Tensor], bool]:
    """``(w or None, measured)``: the TIS weights of this rank's full responses and whether the
    mismatch metrics were added to ``metrics`` (both log-probs present; module docstring)."""
    has_both = old is not None and rollout is not None
    if cfg.use_tis and not has_both:
        missing = "rollout_log_probs (the engine's)" if rollout is None else "old_log_probs (the trainer's)"
        raise BadBatchError(f"--use-tis needs both old and rollout log-probs; the step batch has no {missing}")
    if not has_both:
        return None, False
    terms = mismatch_terms(old, rollout, loss_mask)
    w = flags = None
    if cfg.use_tis and cfg.custom_tis_function is None:
        w, flags = _tis(cfg, old, rollout, loss_mask, response_lengths)
    w_sm = sample_mean_weights
    if cp_rank == 0:
        metrics.add("mismatch/abs_diff_mean", (terms["abs_diff"] * w_sm).sum())
        metrics.add("mismatch/k3_kl", (terms["k3_kl"] * w_sm).sum())
        if w is not None:
            metrics.add("tis/weight_mean", (w * w_sm).sum())
            metrics.add("tis/clipped_frac", (flags * w_sm).sum())
    abs_diff = terms["abs_diff"]
    metrics.add_max("mismatch/abs_diff_max", torch.where(loss_mask > 0, abs_diff, abs_diff.new_full((), -math.inf)))
    return w, True


def forward_tis_weights(
    old: torch.Tensor, rollout: torch.Tensor, loss_mask: torch.Tensor, response_lengths: torch.Tensor, cfg: LossConfig
) -> torch.Tensor:
    """``old_from_forward``: the TIS weights of one micro-batch's responses from its detached
    log-probs. At CP = 1 its local tokens are its full responses in order, so the token and
    sequence weights are the per-sample functions the whole-step pass computes."""
    w, _ = _tis(cfg, old, rollout, loss_mask, response_lengths)
    return w


def custom_tis(
    full: torch.Tensor,
    sub_batch: StepBatch,
    resp_index: torch.Tensor,
    idx: torch.Tensor,
    step_tensors: Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    cfg: LossConfig,
    metrics: MetricAccumulator,
    metric_names: List[str],
    cp_rank: int,
) -> torch.Tensor:
    """slime's ``--custom-tis-function-path`` hook (``offpolicy.load_custom_tis_function``) on a
    micro-batch's FULL per-token loss ``full``, then this rank's CP slice (``resp_index``) of its
    result. ``idx``: the step-level index of the micro-batch's full responses into
    ``step_tensors`` = (old, rollout, loss mask, sample-mean weights) of the step. The function's
    metrics are added as ``tis/<name>`` sample means (names appended to ``metric_names``)."""
    old, rollout, loss_mask, w_sm_step = step_tensors
    fn: Callable = cfg.custom_tis_function
    dtype = full.dtype
    split = sub_batch.response_lengths.long().tolist()
    out, masks, fn_metrics = fn(
        cfg,
        pg_loss=full,
        train_log_probs=list(old[idx].to(dtype).split(split)),
        rollout_log_probs=list(rollout[idx].to(dtype).split(split)),
        loss_masks=list(loss_mask[idx].split(split)),
        total_lengths=sub_batch.total_lengths.tolist(),
        response_lengths=split,
    )
    if out.shape != full.shape:
        raise ValueError(
            f"--custom-tis-function-path returned pg_loss of shape {tuple(out.shape)}, expected {tuple(full.shape)}"
        )
    new_mask = (
        torch.cat([torch.as_tensor(x) for x in masks]).to(full.device, dtype) if len(masks) else full.new_zeros(0)
    )
    if cp_rank == 0:
        w_sm = w_sm_step[idx]
        for name, value in (fn_metrics or {}).items():
            key = f"tis/{name}"
            if key not in metric_names:
                metric_names.append(key)
            metrics.add(key, (value.detach().to(torch.float64).reshape(-1) * w_sm).sum())
    return (out * new_mask)[resp_index]
