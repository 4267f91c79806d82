"""Off-policy correction between the engine's sampling policy and the trainer's old policy:
truncated / masked importance sampling (``rl_plugin.loss.offpolicy``), and DeepSpeed parity (the
gradient-scale decoupling and DeepSpeed's metric names).

Names follow slime where slime has the flag (``--use-tis``, ``--tis-clip``, ``--tis-clip-low``,
``--custom-tis-function-path``); level and mode follow verl's ``rollout_is_level`` /
``rollout_is_mode``. The field names match slime's args, for custom TIS functions."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from rl_plugin.errors import fail
from rl_plugin.flags import derived, flag, runtime
from rl_plugin.registries import TIS_LEVELS, TIS_MODES
from rl_plugin.user_code import check_importable, load_function

GROUP = "off-policy correction"
DEFAULT_TIS_CLIP, DEFAULT_TIS_CLIP_LOW = 2.0, 0.0


def load_tis_function(path: Optional[str]) -> Optional[Callable]:
    """The function ``--custom-tis-function-path`` names (slime's signature, rl_plugin.loss.offpolicy.load_custom_tis_function)."""
    return load_function(path, "--custom-tis-function-path") if path else None


@dataclass(frozen=True)
class OffPolicySettings:
    use_tis: bool = flag(
        "--use-tis",
        action="store_true",
        help=(
            "Correct the train-inference mismatch: multiply each token's policy loss by a detached importance weight "
            "w = f(pi_old / pi_rollout) before aggregation (truncated IS, Yao et al. 2025 'Your efficient RL framework "
            "secretly brings you off-policy RL training'; slime --use-tis, verl rollout_is). Use with a real inference "
            "engine (bf16, its own kernels) or asynchronous rollouts, whose log-probs differ from the trainer's."
        ),
        group=GROUP,
    )
    tis_clip: float = flag(
        "--tis-clip",
        type=float,
        default=DEFAULT_TIS_CLIP,
        help="Upper bound C of the importance weight (truncate: w = min(rho, C); mask: tokens/sequences with rho > C get w = 0). slime's default 2.0; verl uses 2.0 for token level.",
        group=GROUP,
    )
    tis_clip_low: float = flag(
        "--tis-clip-low",
        type=float,
        default=DEFAULT_TIS_CLIP_LOW,
        help="Lower bound of the weight (truncate: w = max(rho, low); mask: rho < low gets w = 0). 0 = no lower bound (plain TIS). IcePop (Ling team 2025) uses 0.5 with --tis-mode mask.",
        group=GROUP,
    )
    tis_level: str = flag(
        "--tis-level",
        choices=TIS_LEVELS,
        default="token",
        help=(
            "Where rho is taken: token: rho_t = exp(d_t); sequence: rho_i = exp(sum_t d_t), the full sequence likelihood ratio "
            "(unbiased, high variance; verl 'sequence'); geometric: rho_i = exp(mean_t d_t), its length-normalised geometric "
            "mean (verl 'geometric', pair with a tight band). d_t = log pi_old - log pi_rollout over masked tokens; a sequence "
            "weight is carried by all its tokens."
        ),
        group=GROUP,
    )
    tis_mode: str = flag(
        "--tis-mode",
        choices=TIS_MODES,
        default="truncate",
        help="truncate: clip the weight into [--tis-clip-low, --tis-clip] (TIS). mask: keep rho inside the band and zero the token (or sequence) outside it: masked importance sampling / IcePop, which drops tokens the engine and the trainer disagree on.",
        group=GROUP,
    )
    custom_tis_function_path: Optional[str] = flag(
        "--custom-tis-function-path",
        type=str,
        default=None,
        help="Replace the built-in weight with your function ('package.module:function' or 'file.py:function'), slime's signature: fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, **kw) -> (pg_loss, loss_masks, metrics), over a micro-batch's full responses (gathered over CP). Needs --use-tis.",
        group=GROUP,
    )
    custom_tis_function: Optional[Callable] = derived(  # loaded once
        lambda args: load_tis_function(args.custom_tis_function_path), None, user_code=True
    )
    # DeepSpeed parity: backward objective x 1/N, reported J unchanged
    deepspeed_grad_scale: bool = flag(
        "--deepspeed-grad-scale",
        action="store_true",
        help=(
            "DeepSpeed parity when normalising by documents (Fast-LLM PR #502): the reported loss stays J = (1/N) sum_i "
            "l_i, but the gradient applied is dJ/dtheta / N (DeepSpeed divides the already document-averaged loss once "
            "more, so its gradient is the sum over documents / N^2). Use only to reproduce a DeepSpeed run; it shrinks "
            "the update by 1/N (under Adam mostly a change of epsilon and clipping)."
        ),
        group=GROUP,
    )
    deepspeed_metric_names: bool = flag(
        "--deepspeed-metric-names",
        action="store_true",
        help="Also log the policy-gradient metrics under DeepSpeed's names (ratio_new_old, ratio_new_old_sum, ratio_new_old_squared_sum, kl_new_old, clipped_ratio_fraction, advantage, max_advantage, min_advantage, num_tokens, entropy, old_logprobs) besides the slime-style ones. (Under --docs-per-step the loop always logs num_documents / documents_seen per step.)",
        group=GROUP,
    )

    # --ci-test with --ci-train-rollout-logprob-abs-diff-threshold (rl_plugin.configs.ci_checks): each step
    # reports its worst token |old - rollout| (rl_plugin.loss.worst_token); given by the run config
    report_worst_token: bool = runtime(False)
    # --ci-test's actor = reference check (rl_plugin.configs.ci_checks): each step also reports its worst token
    # |old - ref| (ci/actor_ref_*, rl_plugin.loss.worst_token); given by the run config
    report_actor_ref: bool = runtime(False)

    def check(self, run) -> None:
        _check_tis(self, run)
        _check_deepspeed(self)


def _check_tis(loss, run) -> None:
    tis_flags = [
        f
        for f, changed in (
            ("--tis-clip", loss.tis_clip != DEFAULT_TIS_CLIP),
            ("--tis-clip-low", loss.tis_clip_low != DEFAULT_TIS_CLIP_LOW),
            ("--tis-level", loss.tis_level != "token"),
            ("--tis-mode", loss.tis_mode != "truncate"),
            ("--custom-tis-function-path", loss.custom_tis_function_path is not None),
        )
        if changed
    ]
    if tis_flags and not loss.use_tis:
        fail(
            f"{', '.join(tis_flags)} without --use-tis",
            "importance sampling is off, so these settings would be silently ignored",
            "add --use-tis, or drop them",
        )
    if not loss.use_tis:
        return
    if run.train.use_rollout_logprobs:
        fail(
            "--use-tis with --use-rollout-logprobs",
            "the old log-probs ARE the engine's, so every importance weight is exactly 1 and nothing is corrected",
            "drop --use-rollout-logprobs (the trainer recomputes old log-probs), or drop --use-tis",
        )
    _check_band(loss.tis_clip, loss.tis_clip_low, loss.tis_mode)
    if run.rollout.engine.top_p is not None and run.rollout.engine.top_p < 1:
        fail(
            f"--use-tis with --rollout-top-p {run.rollout.engine.top_p}",
            "the engine samples from the top-p nucleus and returns log-probs of that renormalised distribution, which gives the tokens outside it probability 0 while the trainer's pi_old does not: pi_old / pi_rollout is then no importance weight for the trainer's distribution",
            "use --rollout-top-p 1.0 with --use-tis",
        )
    if loss.custom_tis_function_path:
        check_importable(loss.custom_tis_function_path, "--custom-tis-function-path")


def _check_band(hi: float, lo: float, mode: str) -> None:
    if not (math.isfinite(hi) and hi > 0):
        fail("--tis-clip", f"the upper bound must be a finite number > 0 (got {hi})", "use e.g. --tis-clip 2.0")
    if not (math.isfinite(lo) and lo >= 0):
        fail(
            "--tis-clip-low",
            f"the lower bound must be a finite number >= 0 (got {lo})",
            "use 0 (no lower bound) or e.g. 0.5",
        )
    if lo >= hi:
        fail(
            f"--tis-clip-low {lo} with --tis-clip {hi}",
            "the bounds are inverted or empty: every weight would be the same constant (truncate) or 0 (mask)",
            "use --tis-clip-low < --tis-clip, e.g. 0.5 and 2.0",
        )
    if mode == "truncate" and not lo <= 1 <= hi:
        effect = (
            f"every weight is at most {hi:g}, so every token's gradient shrinks at least {1 / hi:.3g}-fold"
            if hi < 1
            else f"every weight is at least {lo:g}, so every token's gradient grows at least {lo:g}-fold"
        )
        fail(
            f"--tis-mode truncate with the band [{lo:g}, {hi:g}]",
            f"the band excludes rho = 1, so even tokens on which the engine and the trainer agree are reweighted: {effect}",
            "use a band around 1, e.g. --tis-clip 2.0 (plain TIS, --tis-clip-low 0) or --tis-clip-low 0.5 --tis-clip 2.0",
        )
    if mode == "mask" and not lo < 1 < hi:
        fail(
            f"--tis-mode mask with the band [{lo}, {hi}]",
            "the band excludes rho = 1, so even tokens on which the engine and the trainer agree are masked out",
            "use a band around 1, e.g. --tis-clip-low 0.5 --tis-clip 2.0",
        )


def _check_deepspeed(loss) -> None:
    if loss.deepspeed_grad_scale:
        agg = loss.loss_aggregation
        if agg != "sample_mean" or loss.per_token_loss_flag or loss.custom_pg_loss_reducer_function_path:
            fail(
                "--deepspeed-grad-scale",
                f"DeepSpeed's loss / N, gradient / N^2 applies when normalising by documents, not with --loss-aggregation {agg} or a custom reducer",
                "use --loss-aggregation sample_mean without a custom reducer, or drop --deepspeed-grad-scale",
            )
    if loss.deepspeed_metric_names and loss.pg_metrics == "none":
        fail(
            "--deepspeed-metric-names with --pg-metrics none",
            "there are no policy-gradient metrics to log under DeepSpeed's names",
            "use --pg-metrics basic (or with_entropy for 'entropy')",
        )
