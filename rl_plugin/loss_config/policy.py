"""The policy loss: estimator (which picks the loss), clipping, KL and entropy terms, and the
metrics the step reports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rl_plugin.errors import fail
from rl_plugin.flags import derived, flag
from rl_plugin.registries import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS

GROUP = "policy loss"
# Estimators whose baseline is the sample's own prompt group (group mean, leave-one-out mean):
# with one sample per prompt every advantage is exactly 0.
GROUP_RELATIVE = ("grpo", "gspo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")


@dataclass(frozen=True)
class PolicySettings:
    advantage_estimator: str = flag(
        "--advantage-estimator",
        choices=ADVANTAGE_ESTIMATORS.names,
        default="grpo",
        help=(
            "grpo: group-normalised rewards (Shao et al. 2024, DeepSeekMath). "
            "gspo: grpo advantages with the sequence-level, length-normalised importance ratio of GSPO (Zheng et al. 2025); "
            "use for MoE or long responses where token ratios are noisy. "
            "dr_grpo: group mean subtracted, no std division (Liu et al. 2025, Dr.GRPO); pair with --loss-aggregation constant. "
            "rloo: leave-one-out baseline (Ahmadian et al. 2024); needs --n-samples-per-prompt >= 2. "
            "reinforce_plus_plus_baseline: group mean subtracted, then whitened over the batch (Hu 2025, REINFORCE++). "
            "ppo: PPO with a learned critic (Schulman et al. 2017): per-token GAE advantages over the critic's values "
            "(Schulman et al. 2016), the critic trained beside the actor (its flags: the critic section); works with "
            "one sample per prompt and long multi-turn episodes."
        ),
        group=GROUP,
    )
    policy_loss: str = derived(  # the loss the estimator asks for (rl_plugin.registries.POLICY_LOSSES)
        lambda args: "gspo" if args.advantage_estimator == "gspo" else "ppo_clip", "ppo_clip"
    )
    eps_clip: float = flag(
        "--eps-clip",
        type=float,
        default=0.2,
        help="PPO clip range: the ratio is clipped to [1 - eps, 1 + eps-high] (Schulman et al. 2017). GSPO uses ~3e-4 since its ratio is per sequence.",
        group=GROUP,
    )
    eps_clip_high: Optional[float] = flag(
        "--eps-clip-high",
        type=float,
        default=None,
        help="Upper clip bound, if different from --eps-clip: DAPO's clip-higher (Yu et al. 2025) uses 0.28 to keep exploration alive. Default: --eps-clip.",
        group=GROUP,
    )
    eps_clip_c: Optional[float] = flag(
        "--eps-clip-c",
        type=float,
        default=None,
        help="Dual-clip constant c > 1: for negative advantages the loss is capped at -A*c (Ye et al. 2020), bounding updates from stale, low-probability tokens. Typical: 3.",
        group=GROUP,
    )
    use_kl_loss: bool = flag(
        "--use-kl-loss",
        action="store_true",
        help="Add kl_loss_coef x KL(policy || reference) to the objective (a reference forward pass per step).",
        group=GROUP,
    )
    kl_loss_coef: float = flag(
        "--kl-loss-coef", type=float, default=0.0, help="Coefficient of the KL loss; needs --use-kl-loss.", group=GROUP
    )
    kl_loss_type: str = flag(
        "--kl-loss-type",
        choices=KL_ESTIMATORS.names,
        default="low_var_kl",
        help="KL estimator (Schulman 2020): k1, k2, k3, or low_var_kl (clamped k3, as in verl/slime).",
        group=GROUP,
    )
    entropy_coef: float = flag(
        "--entropy-coef",
        type=float,
        default=0.0,
        help="Entropy bonus: subtract entropy_coef x mean token entropy from the objective. 0 disables.",
        group=GROUP,
    )
    pg_metrics: str = flag(  # no combination of metric flags changes the objective
        "--pg-metrics",
        choices=["none", "basic", "with_entropy"],
        default="basic",
        help="Policy-gradient metrics per step: basic = old log-prob, ratio mean/sum/squared sum, KL(old||new), clip fraction, advantage mean/min/max, token count; with_entropy adds the token entropy (one extra reduction per token chunk). Diagnostics use the sample mean whatever --loss-aggregation is.",
        group="metrics",
    )

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef != 0.0 or self.pg_metrics == "with_entropy"

    def check(self, run) -> None:
        for name, value in (("--eps-clip", self.eps_clip), ("--eps-clip-high", self.eps_clip_high)):
            if value is not None and not value > 0:
                fail(
                    name,
                    f"the clip range must be > 0 (got {value}); <= 0 clips every ratio to a constant and the policy gradient vanishes",
                    f"use e.g. {name} 0.2",
                )
        high = self.eps_clip_high
        if high is not None and self.eps_clip is not None and 0 < high < self.eps_clip:
            fail(
                f"--eps-clip-high {high} with --eps-clip {self.eps_clip}",
                "the upper clip bound is tighter than the lower one; clip-higher (DAPO) widens the upper bound to keep "
                "exploration alive, and a narrower one is almost always the two values swapped",
                f"use --eps-clip {high} --eps-clip-high {self.eps_clip}, or drop --eps-clip-high for a symmetric clip",
            )
        if self.eps_clip_c is not None and not self.eps_clip_c > 1:
            fail(
                "--eps-clip-c",
                f"the dual-clip constant must be > 1 (got {self.eps_clip_c}); c <= 1 caps the loss below the clipped PPO loss",
                "use e.g. --eps-clip-c 3, or drop it",
            )
        if self.kl_loss_coef != 0 and not self.use_kl_loss:
            fail(
                "--kl-loss-coef without --use-kl-loss",
                "the KL coefficient would be silently ignored",
                "add --use-kl-loss, or drop --kl-loss-coef",
            )
