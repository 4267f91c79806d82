"""How the per-token policy loss becomes one step objective J: the aggregation mode (resolved once
from ``--loss-aggregation`` and Megatron-LM's ``--calculate-per-token-loss``), its divisor, a custom
reducer. See DESIGN.md for the exact J of each mode; ``rl_plugin.loss.aggregation`` implements them
(and documents the custom reducer's signature)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from rl_plugin.errors import fail
from rl_plugin.flags import MEGATRON, derived, flag
from rl_plugin.registries import LOSS_AGGREGATIONS
from rl_plugin.user_code import load_function

DEFAULT_MODE = "sample_mean"
GROUP = "loss aggregation"


def resolved_mode(args) -> str:
    """The aggregation mode the flags ask for: ``--loss-aggregation``, else token_mean under
    Megatron-LM's ``--calculate-per-token-loss`` (ours, or Megatron-LM's own), else sample_mean. A
    pure function of the flags as given, held once (``loss_aggregation``); the rules read that field."""
    if args.loss_aggregation is not None:
        return args.loss_aggregation
    return "token_mean" if args.calculate_per_token_loss else DEFAULT_MODE


def load_reducer(path: Optional[str]) -> Optional[Callable]:
    """The factory ``--custom-pg-loss-reducer-function-path`` names (rl_plugin.loss.aggregation.CustomReducerFactory)."""
    return load_function(path, "--custom-pg-loss-reducer-function-path") if path else None


@dataclass(frozen=True)
class AggregationSettings:
    # --loss-aggregation and --calculate-per-token-loss as given (validated flags carry the resolved
    # mode in both: rl_plugin.arguments writes it once); the mode the loss reads is loss_aggregation
    loss_aggregation_flag: Optional[str] = flag(
        "--loss-aggregation",
        choices=LOSS_AGGREGATIONS.names,
        default=None,
        help=(
            "How the policy loss is averaged over a step; every denominator is global over the step. "
            "sample_mean (default): mean over samples of each sample's token mean, GRPO (Shao et al. 2024). "
            "token_mean: mean over all response tokens of the step, DAPO (Yu et al. 2025); long answers weigh more. "
            "prompt_mean: mean over prompt groups of each group's token mean, ScaleRL (Khatri et al. 2025). "
            "constant: each sample's token sum divided by a fixed --loss-aggregation-divisor, then averaged over "
            "samples, Dr.GRPO (Liu et al. 2025); removes the length bias of per-sample means."
        ),
        group=GROUP,
    )
    per_token_loss_flag: bool = flag(
        "--calculate-per-token-loss",
        action="store_true",
        help="Megatron-LM's per-token loss normalisation. In rl_plugin the legacy spelling of --loss-aggregation token_mean.",
        **MEGATRON,
    )
    loss_aggregation: str = derived(resolved_mode, DEFAULT_MODE)  # the mode, resolved once
    loss_aggregation_divisor: Optional[float] = flag(
        "--loss-aggregation-divisor",
        type=float,
        default=None,
        help="The constant L of --loss-aggregation constant (Dr.GRPO uses the maximum response length, e.g. 4096). Only valid with constant.",
        group=GROUP,
    )
    custom_pg_loss_reducer_function_path: Optional[str] = flag(
        "--custom-pg-loss-reducer-function-path",
        type=str,
        default=None,
        help=(
            "A miles-compatible reducer factory, 'package.module:function' or 'file.py:function' (the forms of "
            "--custom-rm-path), "
            "fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer(x) -> scalar, "
            "called per micro-batch on FULL responses (rl_plugin gathers CP chunks first). Its value is a sum over "
            "the micro-batch; rl_plugin divides it by the global sample count (token count with "
            "--calculate-per-token-loss). Replaces --loss-aggregation for the policy loss, so it cannot be combined "
            "with a non-default --loss-aggregation."
        ),
        group=GROUP,
    )
    custom_pg_reducer: Optional[Callable] = derived(  # the factory, loaded once
        lambda args: load_reducer(args.custom_pg_loss_reducer_function_path), None, user_code=True
    )

    @property
    def calculate_per_token_loss(self) -> bool:
        """Megatron-LM's name of the token_mean mode (a custom reducer's fourth argument)."""
        return self.loss_aggregation == "token_mean"

    def check(self, run) -> None:
        explicit = self.loss_aggregation_flag
        per_token = bool(self.per_token_loss_flag)
        mode = self.loss_aggregation
        if self.custom_pg_loss_reducer_function_path and explicit not in (None, DEFAULT_MODE):
            fail(
                "--custom-pg-loss-reducer-function-path with --loss-aggregation " + explicit,
                "the custom reducer replaces the aggregation mode for the policy loss, so the mode would be silently ignored",
                "drop --loss-aggregation (or the custom reducer)",
            )
        if per_token and explicit in ("constant", "prompt_mean"):
            fail(
                f"--loss-aggregation {explicit} with --calculate-per-token-loss",
                f"{explicit} normalises by its own denominator, while --calculate-per-token-loss normalises by the step's token count",
                f"drop --calculate-per-token-loss to train {explicit}, or use --loss-aggregation token_mean",
            )
        if per_token and explicit == "sample_mean":
            fail(
                "--calculate-per-token-loss with --loss-aggregation sample_mean",
                "--calculate-per-token-loss is the legacy spelling of token_mean and contradicts an explicit sample_mean",
                "keep one: --loss-aggregation sample_mean, or --loss-aggregation token_mean",
            )
        divisor = self.loss_aggregation_divisor
        if mode == "constant" and not (divisor is not None and math.isfinite(divisor) and divisor > 0):
            fail(
                "--loss-aggregation constant",
                f"needs --loss-aggregation-divisor L, a finite number > 0 (got {divisor})",
                "pass --loss-aggregation-divisor L; Dr.GRPO uses the max response length, e.g. 4096",
            )
        if divisor is not None and mode != "constant":
            fail(
                f"--loss-aggregation-divisor with --loss-aggregation {mode}",
                "the divisor is only used by the constant mode and would be silently ignored",
                "add --loss-aggregation constant, or drop --loss-aggregation-divisor",
            )
