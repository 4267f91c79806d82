"""Flags of off-policy correction and DAPO-era rollout control.

- Truncated / masked importance sampling between the engine's sampling policy and the trainer's
  old policy (``rl_plugin/loss/offpolicy.py``), and ``--use-rollout-logprobs``.
- Dynamic sampling and over-long shaping of DAPO (``rl_plugin/rollout/filters.py``).
- DeepSpeed parity: the gradient-scale decoupling and DeepSpeed's metric names.

Names follow slime where slime has the flag (``--use-tis``, ``--tis-clip``, ``--tis-clip-low``,
``--custom-tis-function-path``, ``--use-rollout-logprobs``, ``--over-sampling-batch-size``,
``--dynamic-sampling-filter-path``); level and mode follow verl's ``rollout_is_level`` /
``rollout_is_mode``.
"""

from __future__ import annotations

import math

from rl_plugin.arguments._util import RLArgumentError, add_flag, fail
from rl_plugin.arguments.aggregation import resolved_mode
from rl_plugin.registries import BUILTIN_FILTER, DYNAMIC_SAMPLING_MAX_ROUNDS, TIS_LEVELS, TIS_MODES
from rl_plugin.user_code import FORMS, UserCodeError, load_function

DEFAULT_TIS_CLIP, DEFAULT_TIS_CLIP_LOW = 2.0, 0.0


def add_arguments(parser):
    g = parser.add_argument_group(
        "off-policy correction and rollout control",
        "Importance sampling between the rollout engine and the trainer; DAPO dynamic sampling and over-long shaping.",
    )
    add_flag(
        g,
        "--use-tis",
        action="store_true",
        help=(
            "Correct the train-inference mismatch: multiply each token's policy loss by a detached importance weight "
            "w = f(pi_old / pi_rollout) before aggregation (truncated IS, Yao et al. 2025 'Your efficient RL framework "
            "secretly brings you off-policy RL training'; slime --use-tis, verl rollout_is). Use with a real inference "
            "engine (bf16, its own kernels) or asynchronous rollouts, whose log-probs differ from the trainer's."
        ),
    )
    add_flag(
        g,
        "--tis-clip",
        type=float,
        default=DEFAULT_TIS_CLIP,
        help="Upper bound C of the importance weight (truncate: w = min(rho, C); mask: tokens/sequences with rho > C get w = 0). slime's default 2.0; verl uses 2.0 for token level.",
    )
    add_flag(
        g,
        "--tis-clip-low",
        type=float,
        default=DEFAULT_TIS_CLIP_LOW,
        help="Lower bound of the weight (truncate: w = max(rho, low); mask: rho < low gets w = 0). 0 = no lower bound (plain TIS). IcePop (Ling team 2025) uses 0.5 with --tis-mode mask.",
    )
    add_flag(
        g,
        "--tis-level",
        choices=TIS_LEVELS,
        default="token",
        help=(
            "Where rho is taken: token: rho_t = exp(d_t); sequence: rho_i = exp(sum_t d_t), the full sequence likelihood ratio "
            "(unbiased, high variance; verl 'sequence'); geometric: rho_i = exp(mean_t d_t), its length-normalised geometric "
            "mean (verl 'geometric', pair with a tight band). d_t = log pi_old - log pi_rollout over masked tokens; a sequence "
            "weight is carried by all its tokens."
        ),
    )
    add_flag(
        g,
        "--tis-mode",
        choices=TIS_MODES,
        default="truncate",
        help="truncate: clip the weight into [--tis-clip-low, --tis-clip] (TIS). mask: keep rho inside the band and zero the token (or sequence) outside it: masked importance sampling / IcePop, which drops tokens the engine and the trainer disagree on.",
    )
    add_flag(
        g,
        "--custom-tis-function-path",
        type=str,
        default=None,
        help="Replace the built-in weight with your function ('package.module:function' or 'file.py:function'), slime's signature: fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, **kw) -> (pg_loss, loss_masks, metrics), over a micro-batch's full responses (gathered over CP). Needs --use-tis.",
    )
    add_flag(
        g,
        "--use-rollout-logprobs",
        action="store_true",
        help="Use the engine's log-probs as the old log-probs and skip the trainer's recompute pass (slime): saves a forward pass per rollout when the engine and the trainer agree (e.g. true on-policy kernels); the PPO ratio then absorbs any mismatch.",
    )
    add_flag(
        g,
        "--over-sampling-batch-size",
        type=int,
        default=None,
        help="Dynamic sampling (DAPO, Yu et al. 2025): prompts sampled per round; rounds repeat until --rollout-batch-size groups pass --dynamic-sampling-filter-path, and only those are trained on. Default: --rollout-batch-size. Needs the filter.",
    )
    add_flag(
        g,
        "--dynamic-sampling-filter-path",
        type=str,
        default=None,
        help=f"Group filter of dynamic sampling, 'package.module:function' or 'file.py:function' (the forms of --custom-rm-path), slime's signature fn(args, samples, **kw) -> bool (or an object with .keep), deciding on the raw rewards before any shaping. It must return a bool (numpy.bool_ is accepted; None, strings, ints and tensors stop the run at the first group, naming the filter). Built-in: {BUILTIN_FILTER} (keep groups whose rewards are not all equal; DAPO's filter).",
    )
    add_flag(
        g,
        "--dynamic-sampling-max-rounds",
        type=int,
        default=DYNAMIC_SAMPLING_MAX_ROUNDS,
        help="Dynamic sampling: rounds of --over-sampling-batch-size prompts a rollout may generate to fill --rollout-batch-size passing groups before the run stops, naming the counts (each round after the first prints a progress line). Lower it to fail fast on a filter that rejects nearly everything; raise it for a task where few groups pass.",
    )
    add_flag(
        g,
        "--overlong-buffer-len",
        type=int,
        default=None,
        help="DAPO's soft over-long punishment (Yu et al. 2025, sec. 3.4): a response longer than --rollout-max-response-len minus this buffer loses reward linearly, reaching -(--overlong-penalty-factor) at the maximum length. Applied after the dynamic-sampling filter. DAPO uses a 4096-token buffer at 20480.",
    )
    add_flag(
        g,
        "--overlong-penalty-factor",
        type=float,
        default=None,
        help="Maximum over-long penalty (default 1.0 with --overlong-buffer-len, as in DAPO).",
    )
    add_flag(
        g,
        "--debug-rollout-logprob-shift",
        type=float,
        default=0.0,
        help="Testing and debugging only: subtract d from every log-prob the engine returns, i.e. simulate an engine whose sampling policy disagrees with the trainer by log pi_old - log pi_rollout = d on every token, so the TIS weight (exp(d), then clipped) and the mismatch metrics (|d|, e^d - 1 - d) are known exactly. Never use it in training.",
    )
    add_flag(
        g,
        "--deepspeed-grad-scale",
        action="store_true",
        help=(
            "DeepSpeed parity when normalising by documents (Fast-LLM PR #502): the reported loss stays J = (1/N) sum_i "
            "l_i, but the gradient applied is dJ/dtheta / N (DeepSpeed divides the already document-averaged loss once "
            "more, so its gradient is the sum over documents / N^2). Use only to reproduce a DeepSpeed run; it shrinks "
            "the update by 1/N (under Adam mostly a change of epsilon and clipping)."
        ),
    )
    add_flag(
        g,
        "--deepspeed-metric-names",
        action="store_true",
        help="Also log the policy-gradient metrics under DeepSpeed's names (ratio_new_old, ratio_new_old_sum, ratio_new_old_squared_sum, kl_new_old, clipped_ratio_fraction, advantage, max_advantage, min_advantage, num_tokens, entropy, old_logprobs) besides the slime-style ones. (Under --docs-per-step the loop always logs num_documents / documents_seen per step.)",
    )
    return parser


def _importable(flag: str, path: str) -> None:
    """Load the function now (``rl_plugin.user_code``: the forms every user-function flag takes)."""
    try:
        load_function(path, flag)
    except UserCodeError as exc:  # the module raised while importing: names its file:line and the fix
        raise RLArgumentError(str(exc)) from None
    except ValueError as exc:
        reason = getattr(exc, "reason", str(exc))
        fail(flag, f"cannot load the function {path!r}: {reason}", f"pass {FORMS}, importable from here (PYTHONPATH)")


def _validate_tis(args) -> None:
    tis_flags = [
        f
        for f, changed in (
            ("--tis-clip", args.tis_clip != DEFAULT_TIS_CLIP),
            ("--tis-clip-low", args.tis_clip_low != DEFAULT_TIS_CLIP_LOW),
            ("--tis-level", args.tis_level != "token"),
            ("--tis-mode", args.tis_mode != "truncate"),
            ("--custom-tis-function-path", args.custom_tis_function_path is not None),
        )
        if changed
    ]
    if tis_flags and not args.use_tis:
        fail(
            f"{', '.join(tis_flags)} without --use-tis",
            "importance sampling is off, so these settings would be silently ignored",
            "add --use-tis, or drop them",
        )
    if not args.use_tis:
        return
    if args.use_rollout_logprobs:
        fail(
            "--use-tis with --use-rollout-logprobs",
            "the old log-probs ARE the engine's, so every importance weight is exactly 1 and nothing is corrected",
            "drop --use-rollout-logprobs (the trainer recomputes old log-probs), or drop --use-tis",
        )
    hi, lo = args.tis_clip, args.tis_clip_low
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
    if args.tis_mode == "truncate" and not lo <= 1 <= hi:
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
    if args.tis_mode == "mask" and not lo < 1 < hi:
        fail(
            f"--tis-mode mask with the band [{lo}, {hi}]",
            "the band excludes rho = 1, so even tokens on which the engine and the trainer agree are masked out",
            "use a band around 1, e.g. --tis-clip-low 0.5 --tis-clip 2.0",
        )
    if args.rollout_top_p is not None and args.rollout_top_p < 1:
        fail(
            f"--use-tis with --rollout-top-p {args.rollout_top_p}",
            "the engine samples from the top-p nucleus and returns log-probs of that renormalised distribution, which gives the tokens outside it probability 0 while the trainer's pi_old does not: pi_old / pi_rollout is then no importance weight for the trainer's distribution",
            "use --rollout-top-p 1.0 with --use-tis",
        )
    if args.custom_tis_function_path:
        _importable("--custom-tis-function-path", args.custom_tis_function_path)


def _validate_rollout_control(args) -> None:
    osb, path = args.over_sampling_batch_size, args.dynamic_sampling_filter_path
    if osb is not None and path is None:
        fail(
            "--over-sampling-batch-size without --dynamic-sampling-filter-path",
            "over-sampling without a filter samples prompts that are then thrown away unfiltered",
            f"add --dynamic-sampling-filter-path {BUILTIN_FILTER}, or drop --over-sampling-batch-size",
        )
    rounds = args.dynamic_sampling_max_rounds
    if rounds != DYNAMIC_SAMPLING_MAX_ROUNDS and path is None:
        fail(
            "--dynamic-sampling-max-rounds without --dynamic-sampling-filter-path",
            "without a filter a rollout is one round, so the cap would be silently ignored",
            f"add --dynamic-sampling-filter-path {BUILTIN_FILTER}, or drop --dynamic-sampling-max-rounds",
        )
    if rounds < 1:
        fail(
            "--dynamic-sampling-max-rounds",
            f"must be >= 1 (got {rounds})",
            f"use a round count >= 1 (default {DYNAMIC_SAMPLING_MAX_ROUNDS})",
        )
    if osb is not None and osb < 1:
        fail("--over-sampling-batch-size", f"must be >= 1 (got {osb})", "use a prompt count >= --rollout-batch-size")
    rbs = args.rollout_batch_size
    if osb is not None and rbs is not None and osb < rbs:
        fail(
            f"--over-sampling-batch-size {osb} with --rollout-batch-size {rbs}",
            "a round samples fewer prompts than a rollout trains on, so even a round where every group passes cannot fill the batch",
            f"use --over-sampling-batch-size >= {rbs} (DAPO over-samples, e.g. {2 * rbs})",
        )
    if path is not None:
        _importable("--dynamic-sampling-filter-path", path)
    buf, factor = args.overlong_buffer_len, args.overlong_penalty_factor
    if factor is not None and buf is None:
        fail(
            "--overlong-penalty-factor without --overlong-buffer-len",
            "the penalty needs the buffer where it ramps up, so it would be silently ignored",
            "add --overlong-buffer-len N (DAPO: 4096)",
        )
    if factor is not None and not (math.isfinite(factor) and factor >= 0):
        fail("--overlong-penalty-factor", f"must be a finite number >= 0 (got {factor})", "use e.g. 1.0")
    if buf is not None:
        if buf < 1:
            fail(
                "--overlong-buffer-len",
                f"must be >= 1 (got {buf})",
                "use a positive token count, e.g. a quarter of --rollout-max-response-len",
            )
        max_len = args.rollout_max_response_len
        if max_len is not None and buf >= max_len:
            fail(
                f"--overlong-buffer-len {buf} with --rollout-max-response-len {max_len}",
                "the buffer must leave a penalty-free length L_max - buffer > 0, or every response is punished",
                f"use --overlong-buffer-len < {max_len}",
            )


def _validate_debug(args) -> None:
    d = args.debug_rollout_logprob_shift
    if not math.isfinite(d):
        fail(
            "--debug-rollout-logprob-shift",
            f"must be a finite number (got {d})",
            "use e.g. 0.5, or drop the flag (it is for tests only)",
        )
    if d != 0 and args.use_rollout_logprobs:
        fail(
            "--debug-rollout-logprob-shift with --use-rollout-logprobs",
            "the shifted engine log-probs would become the old log-probs and the shift would be trained on, not measured",
            "drop --use-rollout-logprobs",
        )


def _validate_deepspeed(args) -> None:
    if args.deepspeed_grad_scale:
        agg = resolved_mode(args)
        if agg != "sample_mean" or args.calculate_per_token_loss or args.custom_pg_loss_reducer_function_path:
            fail(
                "--deepspeed-grad-scale",
                f"DeepSpeed's loss / N, gradient / N^2 applies when normalising by documents, not with --loss-aggregation {agg} or a custom reducer",
                "use --loss-aggregation sample_mean without a custom reducer, or drop --deepspeed-grad-scale",
            )
    if args.deepspeed_metric_names and args.pg_metrics == "none":
        fail(
            "--deepspeed-metric-names with --pg-metrics none",
            "there are no policy-gradient metrics to log under DeepSpeed's names",
            "use --pg-metrics basic (or with_entropy for 'entropy')",
        )


def validate(args) -> None:
    _validate_tis(args)
    _validate_rollout_control(args)
    _validate_debug(args)
    _validate_deepspeed(args)
