"""CustomGenerationConfig: slime's rollout hooks, a custom generate function per sample or a
whole-rollout function (``rl_plugin.rollout.generation.hooks`` runs them;
``rl_plugin.rollout.generate_tokens`` is their way to the engines). ``RolloutConfig`` carries these
fields under the same names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rl_plugin.configs._checks import is_positive_finite
from rl_plugin.errors import fail
from rl_plugin.flags import Declared, flag
from rl_plugin.user_code import FORMS

# Deadlines of the user's hooks (``rl_plugin.rollout.deadlines``). Finite by default: a tool or an
# API that never answers must stop the run with the hook and the sample named, not freeze it
# silently. Generous, so that no real rollout meets them: a hook's samples all start together,
# so a sample's deadline bounds its share of the whole generation (a 16k-token response at ~20
# tokens/s on a loaded engine is ~15 min); the rollout function generates the whole rollout.
DEFAULT_GENERATE_TIMEOUT_S = 1800.0
DEFAULT_ROLLOUT_FUNCTION_TIMEOUT_S = 3600.0
DEFAULT_AGENT_TIMEOUT_S = 1800.0


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

    custom_agent_function_path: Optional[str] = flag(
        "--custom-agent-function-path",
        type=str,
        default=None,
        group="custom generation",
        help=(
            f"Generate every sample with an unmodified agent program ({FORMS}), miles' signature: async def "
            "run_agent(base_url, prompt, request_kwargs=None) [-> reward number or dict], with an optional async def "
            "abort(args) beside it. The rollout serves an OpenAI-compatible endpoint on its node (one port per run, "
            "printed at start); each sample is one session: the agent calls base_url + '/v1/chat/completions' (or "
            "'/v1/completions') with any OpenAI client, as often as it likes. Every completion's token ids and "
            "log-probs are recorded as generated; an append-only session becomes one sample (loss mask 1 on the "
            "model's completions only), else one sample per turn (agent/non_append_turns). The reward: the agent's "
            "return value, else the run's reward on the final conversation. docs/design.md, 'Agent sessions'."
        ),
    )
    agent_timeout: Optional[float] = flag(
        "--agent-timeout",
        type=float,
        default=None,
        group="custom generation",
        help=(
            "Seconds one agent episode (one sample's run_agent call, its requests included; all episodes start "
            "together) may take; past it the agent is cancelled, its session answers 409, and the rollout stops naming "
            "the agent and the sample. An agent that blocks its event loop (a synchronous call inside async def) is "
            "stopped a few seconds later, naming the line that blocks. Needs --custom-agent-function-path. Default: "
            f"{DEFAULT_AGENT_TIMEOUT_S:g}."
        ),
    )
    custom_generate_timeout: Optional[float] = flag(
        "--custom-generate-timeout",
        type=float,
        default=None,
        group="custom generation",
        help=(
            "Seconds one sample may spend in --custom-generate-function-path's hook (its generate_tokens calls "
            "included; all samples start together). A sample past it stops the rollout naming the hook, its file:line "
            "and the sample (index, group, prompt), so a stuck tool cannot freeze the run. A plain `def` hook runs in a "
            "worker thread, which a deadline cannot interrupt: it is left behind. Needs --custom-generate-function-path. "
            f"Default: {DEFAULT_GENERATE_TIMEOUT_S:g} (raise it for long agentic samples)."
        ),
    )
    rollout_function_timeout: Optional[float] = flag(
        "--rollout-function-timeout",
        type=float,
        default=None,
        group="custom generation",
        help=(
            "Seconds one call of --rollout-function-path's function (a whole rollout) may take; past it the rollout "
            "stops naming the function, its file:line and the rollout. Needs --rollout-function-path. Default: "
            f"{DEFAULT_ROLLOUT_FUNCTION_TIMEOUT_S:g}."
        ),
    )

    def check(self, run) -> None:
        """The combinations and the deadlines; the files themselves are loaded in preflight
        (``loop.preflight.check_user_functions``)."""
        gen, fn = self.custom_generate_function_path, self.rollout_function_path
        for flag_name, value, hook, hook_flag in (
            ("--custom-generate-timeout", self.custom_generate_timeout, gen, "--custom-generate-function-path"),
            ("--rollout-function-timeout", self.rollout_function_timeout, fn, "--rollout-function-path"),
            ("--agent-timeout", self.agent_timeout, self.custom_agent_function_path, "--custom-agent-function-path"),
        ):
            if value is None:
                continue
            if not hook:  # as --rm-timeout without a reward that reads it
                fail(
                    f"{flag_name} without {hook_flag}",
                    f"it bounds a call of {hook_flag}'s function, which is not set, so it would be silently ignored",
                    f"add {hook_flag}, or drop {flag_name}",
                )
            if not is_positive_finite(value):
                fail(flag_name, f"must be a positive number of seconds (got {value})", f"use e.g. {flag_name} 600")
        if gen and fn:
            fail(
                "--custom-generate-function-path with --rollout-function-path",
                "the rollout function replaces the rollout that would call the generate function",
                "drop one of the two (call your generate function from the rollout function)",
            )
        self._check_agent(run)
        if fn and run.dynamic_sampling.dynamic_sampling_filter_path:
            fail(
                "--rollout-function-path with --dynamic-sampling-filter-path",
                "the rollout function replaces the rollout, dynamic sampling's rounds included",
                "filter inside the rollout function, or drop --rollout-function-path",
            )

    def _check_agent(self, run) -> None:
        """The agent replaces per-sample generation; its rollout's sample count varies (a turn
        that rewrote the history is a sample of its own), so its steps are sized by the rollout
        (``steps_global_batch_size``). Its reward may be the agent's own number: no reward flag
        is needed, except for the evaluation, which keeps the plain rollout."""
        if not self.custom_agent_function_path:
            return
        for other, value in (
            ("--custom-generate-function-path", self.custom_generate_function_path),
            ("--rollout-function-path", self.rollout_function_path),
            ("--dynamic-sampling-filter-path", run.dynamic_sampling.dynamic_sampling_filter_path),
        ):
            if value:
                fail(
                    f"--custom-agent-function-path with {other}",
                    "the agent generates every sample through its session; the other hook would replace or filter that",
                    f"drop one of the two (call your tools from the agent instead of {other})",
                )
        gbs, nominal = run.train.batching.global_batch_size, nominal_rollout_size(run)
        if gbs is not None and gbs != nominal:
            fail(
                f"--custom-agent-function-path with --global-batch-size {gbs}",
                "an agent rollout's sample count varies (a turn whose prompt does not extend the previous one becomes a "
                f"sample of its own), so a fixed number of samples per step other than the rollout's ({nominal}) may "
                "not divide it",
                f"use --global-batch-size {nominal} (--rollout-batch-size x --n-samples-per-prompt: one optimizer step "
                "per rollout, however many samples its episodes made), drop it, or size steps with --docs-per-step",
            )
        if run.rollout.eval_interval and not (run.rewards.rm_type or run.rewards.custom_rm_path):
            fail(
                "--custom-agent-function-path with --eval-interval and no --rm-type or --custom-rm-path",
                "evaluation keeps the plain rollout (no agent), which only the run's reward can score",
                "pass --rm-type or --custom-rm-path, or drop --eval-interval",
            )


def nominal_rollout_size(run) -> Optional[int]:
    """``--rollout-batch-size x --n-samples-per-prompt`` of the run config (None: no rollout size given)."""
    if run.rollout.rollout_batch_size is None:
        return None
    return int(run.rollout.rollout_batch_size) * int(run.rollout.n_samples_per_prompt)


def steps_global_batch_size(run) -> Optional[int]:
    """The loop's samples per optimizer step: ``--global-batch-size``, except that an agent run's
    value equal to the rollout's nominal size means one step per rollout (None), whatever the
    sample count its episodes made (an episode whose turns rewrote the history is several
    samples: the step takes them all, each weighed as one sample of its prompt's group)."""
    gbs = run.train.batching.global_batch_size
    if run.custom_generation.custom_agent_function_path and gbs is not None and gbs == nominal_rollout_size(run):
        return None
    return gbs
