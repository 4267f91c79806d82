"""CustomGenerationConfig: slime's rollout hooks, a custom generate function per sample or a
whole-rollout function (``rl_plugin.rollout.custom_rollout`` runs them;
``rl_plugin.rollout.generate_tokens`` is their way to the engines). ``RolloutConfig`` carries these
fields under the same names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rl_plugin.errors import fail
from rl_plugin.flags import Declared, flag
from rl_plugin.user_code import FORMS


@dataclass(frozen=True)
class CustomGenerationConfig(Declared):
    custom_generate_function_path: Optional[str] = flag(
        "--custom-generate-function-path",
        type=str,
        default=None,
        group="custom generation",
        help=(
            f"Generate every sample with your function ({FORMS}), slime's signature: async def fn(args, sample, "
            "sampling_params) -> Sample. It calls `await rl_plugin.rollout.generate_tokens(args, input_ids, "
            "sampling_params)` (output_ids, output_log_probs, finish_reason) as often as it likes, appends the ids to "
            "sample.tokens and sets response_length, loss_mask (0 for ids it appended itself, e.g. tool output: "
            "conditioned on, never trained or counted), rollout_log_probs (0.0 for those) and status; "
            "metadata['turns'] / metadata['tool_calls'] feed the multi_turn/* metrics. All samples run concurrently; "
            "their requests are batched to the engines. The trainer trains on exactly sample.tokens."
        ),
    )
    rollout_function_path: Optional[str] = flag(
        "--rollout-function-path",
        type=str,
        default=None,
        group="custom generation",
        help=(
            f"Replace the whole rollout with your function ({FORMS}), slime's signature: [async] def fn(args, "
            "rollout_id, data_source, evaluation=False) -> list[list[Sample]]; data_source.get_samples(k) hands out "
            "the next k prompt groups; return --rollout-batch-size groups of --n-samples-per-prompt filled-in samples "
            "(scored afterwards by the run's reward, --rm-type or --custom-rm-path). Evaluation (--eval-interval) keeps the plain "
            "rollout."
        ),
    )

    @classmethod
    def check(cls, args) -> None:
        """The combinations; the files themselves are checked with the other paths (``arguments.paths``)."""
        gen, fn = args.custom_generate_function_path, args.rollout_function_path
        if gen and fn:
            fail(
                "--custom-generate-function-path with --rollout-function-path",
                "the rollout function replaces the rollout that would call the generate function",
                "drop one of the two (call your generate function from the rollout function)",
            )
        if fn and args.dynamic_sampling_filter_path:
            fail(
                "--rollout-function-path with --dynamic-sampling-filter-path",
                "the rollout function replaces the rollout, dynamic sampling's rounds included",
                "filter inside the rollout function, or drop --rollout-function-path",
            )
