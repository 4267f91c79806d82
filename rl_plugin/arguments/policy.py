"""Flags of the policy loss: estimator, clipping, KL and entropy terms."""

from __future__ import annotations

from rl_plugin.arguments._util import add_flag, fail
from rl_plugin.registries import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS

# Estimators whose baseline is the sample's own prompt group (group mean, leave-one-out mean):
# with one sample per prompt every advantage is exactly 0.
GROUP_RELATIVE = ("grpo", "gspo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")


def add_arguments(parser):
    g = parser.add_argument_group("policy loss", "Advantage estimator, clipping, KL and entropy terms.")
    add_flag(
        g,
        "--advantage-estimator",
        choices=ADVANTAGE_ESTIMATORS.names(),
        default="grpo",
        help=(
            "grpo: group-normalised rewards (Shao et al. 2024, DeepSeekMath). "
            "gspo: grpo advantages with the sequence-level, length-normalised importance ratio of GSPO (Zheng et al. 2025); "
            "use for MoE or long responses where token ratios are noisy. "
            "dr_grpo: group mean subtracted, no std division (Liu et al. 2025, Dr.GRPO); pair with --loss-aggregation constant. "
            "rloo: leave-one-out baseline (Ahmadian et al. 2024); needs --n-samples-per-prompt >= 2. "
            "reinforce_plus_plus_baseline: group mean subtracted, then whitened over the batch (Hu 2025, REINFORCE++)."
        ),
    )
    add_flag(
        g,
        "--eps-clip",
        type=float,
        default=0.2,
        help="PPO clip range: the ratio is clipped to [1 - eps, 1 + eps-high] (Schulman et al. 2017). GSPO uses ~3e-4 since its ratio is per sequence.",
    )
    add_flag(
        g,
        "--eps-clip-high",
        type=float,
        default=None,
        help="Upper clip bound, if different from --eps-clip: DAPO's clip-higher (Yu et al. 2025) uses 0.28 to keep exploration alive. Default: --eps-clip.",
    )
    add_flag(
        g,
        "--eps-clip-c",
        type=float,
        default=None,
        help="Dual-clip constant c > 1: for negative advantages the loss is capped at -A*c (Ye et al. 2020), bounding updates from stale, low-probability tokens. Typical: 3.",
    )
    add_flag(
        g,
        "--use-kl-loss",
        action="store_true",
        help="Add kl_loss_coef x KL(policy || reference) to the objective (a reference forward pass per step).",
    )
    add_flag(g, "--kl-loss-coef", type=float, default=0.0, help="Coefficient of the KL loss; needs --use-kl-loss.")
    add_flag(
        g,
        "--kl-loss-type",
        choices=KL_ESTIMATORS.names(),
        default="low_var_kl",
        help="KL estimator (Schulman 2020): k1, k2, k3, or low_var_kl (clamped k3, as in verl/slime).",
    )
    add_flag(
        g,
        "--entropy-coef",
        type=float,
        default=0.0,
        help="Entropy bonus: subtract entropy_coef x mean token entropy from the objective. 0 disables.",
    )
    return parser


def validate(args) -> None:
    for flag, value in (("--eps-clip", args.eps_clip), ("--eps-clip-high", args.eps_clip_high)):
        if value is not None and not value > 0:
            fail(
                flag,
                f"the clip range must be > 0 (got {value}); <= 0 clips every ratio to a constant and the policy gradient vanishes",
                f"use e.g. {flag} 0.2",
            )
    high = args.eps_clip_high
    if high is not None and args.eps_clip is not None and 0 < high < args.eps_clip:
        fail(
            f"--eps-clip-high {high} with --eps-clip {args.eps_clip}",
            "the upper clip bound is tighter than the lower one; clip-higher (DAPO) widens the upper bound to keep "
            "exploration alive, and a narrower one is almost always the two values swapped",
            f"use --eps-clip {high} --eps-clip-high {args.eps_clip}, or drop --eps-clip-high for a symmetric clip",
        )
    if args.eps_clip_c is not None and not args.eps_clip_c > 1:
        fail(
            "--eps-clip-c",
            f"the dual-clip constant must be > 1 (got {args.eps_clip_c}); c <= 1 caps the loss below the clipped PPO loss",
            "use e.g. --eps-clip-c 3, or drop it",
        )
    if args.kl_loss_coef != 0 and not args.use_kl_loss:
        fail(
            "--kl-loss-coef without --use-kl-loss",
            "the KL coefficient would be silently ignored",
            "add --use-kl-loss, or drop --kl-loss-coef",
        )
