"""BatchingConfig: how a rollout becomes optimizer steps and micro-batches (by count or token budget)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rl_plugin.errors import fail
from rl_plugin.flags import MEGATRON, Bounds, Declared, derived, flag
from rl_plugin.loss_config import LossConfig

GROUP = "batching"


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


@dataclass(frozen=True)
class BatchingConfig(Declared):
    micro_batch_size: int = flag(
        "--micro-batch-size",
        type=int,
        default=1,
        help="Samples per micro-batch per data-parallel rank (Megatron-LM).",
        bounds=Bounds(1, "--micro-batch-size 1"),
        **MEGATRON,
    )
    use_dynamic_batch_size: bool = flag(
        "--use-dynamic-batch-size",
        action="store_true",
        help="Form micro-batches by a token budget (--max-tokens-per-gpu) instead of --micro-batch-size, as in slime.",
        group=GROUP,
    )
    token_budget: Optional[int] = flag(  # --max-tokens-per-gpu as given (read as max_tokens_per_gpu)
        "--max-tokens-per-gpu",
        type=int,
        default=None,
        help="Token budget of one micro-batch with --use-dynamic-batch-size.",
        group=GROUP,
    )
    max_tokens_per_gpu: Optional[int] = derived(  # the token budget, set only with --use-dynamic-batch-size
        lambda args: args.max_tokens_per_gpu if args.use_dynamic_batch_size else None, None
    )
    global_batch_size: Optional[int] = flag(
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per optimizer step over all data-parallel ranks (Megatron-LM). Mutually exclusive with --docs-per-step.",
        **MEGATRON,
    )
    docs_per_step: Optional[int] = flag(
        "--docs-per-step",
        type=int,
        default=None,
        help="Size a step by documents instead of --global-batch-size: a step ends once the global document count reaches this target (micro-batches are accumulated until it does). For token-budget micro-batching (--use-dynamic-batch-size), where a fixed sample count per step does not fit.",
        group=GROUP,
    )
    n_samples_per_prompt: int = flag(
        "--n-samples-per-prompt",
        type=int,
        default=8,
        help="Responses sampled per prompt; one prompt's responses form a group for group-relative advantages and prompt_mean.",
        group=GROUP,
        bounds=Bounds(1, "--n-samples-per-prompt 8"),
    )
    rollout_batch_size: Optional[int] = flag(  # required with --prompt-data; the embedded run sets it
        "--rollout-batch-size",
        type=int,
        default=None,
        group="rollout",
        help="Prompts per rollout; each yields --n-samples-per-prompt responses. Default: 16 for the embedded task, else required.",
    )

    def check(self, run) -> None:
        n = self.n_samples_per_prompt
        loss = run.train.loss
        sft = run.mode.trains_nll  # no advantage: one sample per conversation
        if loss.advantage_estimator in LossConfig.GROUP_RELATIVE and n < 2 and not sft:
            baseline = "leave-one-out mean" if loss.advantage_estimator == "rloo" else "group mean"
            fail(
                f"--n-samples-per-prompt {n} with --advantage-estimator {loss.advantage_estimator}",
                f"the advantage subtracts the {baseline} of the prompt's samples, so a group of one sample has advantage 0 "
                "and every optimizer step is a no-op (>= 2 samples per prompt needed)",
                "use --n-samples-per-prompt >= 2 (GRPO recipes use 8-16)",
            )
        mode = loss.loss_aggregation
        if self.docs_per_step is not None:
            self._check_docs_per_step(mode)
        gbs = self.global_batch_size
        if gbs is not None and gbs < 1:
            fail("--global-batch-size", f"must be >= 1 (got {gbs})", "use a positive sample count")
        rollout = self.rollout_batch_size * n if self.rollout_batch_size is not None else None
        if gbs is not None and rollout is not None and self.docs_per_step is None and rollout % gbs != 0:
            fail(
                f"--global-batch-size {gbs}",
                f"a rollout of --rollout-batch-size x --n-samples-per-prompt = {self.rollout_batch_size} x {n} = {rollout} samples must split into whole optimizer steps",
                f"use a --global-batch-size that divides {rollout}, e.g. {_largest_divisor_at_most(rollout, gbs)}",
            )
        if mode == "prompt_mean" and gbs is not None and gbs % n != 0:
            fail(
                f"--loss-aggregation prompt_mean with --global-batch-size {gbs} and --n-samples-per-prompt {n}",
                "a step must never split a prompt group, so the global batch must be a multiple of the group size",
                f"use --global-batch-size {max(n, gbs // n * n)} or {(gbs // n + 1) * n}",
            )
        cp = run.train.model.context_parallel_size
        if cp > 1 and loss.qkv_format == "bshd" and loss.seq_length is None:
            fail(
                f"--context-parallel-size {cp} with --qkv-format bshd",
                "bshd chunks every sample by the padded length, which is --seq-length, and it is missing",
                "pass --seq-length (the padded length), or use --qkv-format thd",
            )
        if self.use_dynamic_batch_size and not self.token_budget:
            fail("--use-dynamic-batch-size", "needs a token budget per micro-batch", "pass --max-tokens-per-gpu N")
        if self.token_budget is not None and self.token_budget < 1:
            fail("--max-tokens-per-gpu", f"must be >= 1 (got {self.token_budget})", "use a positive token budget")

    def _check_docs_per_step(self, mode: str) -> None:
        if self.docs_per_step < 1:
            fail("--docs-per-step", f"must be >= 1 (got {self.docs_per_step})", "use a positive document count")
        if self.global_batch_size is not None:
            fail(
                "--docs-per-step with --global-batch-size",
                "a step is sized by one or the other: docs-per-step ends a step once the global document count reaches its target",
                "drop one of the two flags",
            )
        if mode == "prompt_mean":
            fail(
                "--loss-aggregation prompt_mean with --docs-per-step",
                "a docs-per-step boundary falls wherever the document count crosses the target and can split a prompt group across two optimizer steps",
                f"size steps with --global-batch-size, a multiple of --n-samples-per-prompt ({self.n_samples_per_prompt})",
            )

    def check_world(self, run, *, dp_size: int) -> None:
        """Checks that need the data-parallel size (known once the world is up)."""
        gbs = self.global_batch_size
        if gbs is not None and not self.use_dynamic_batch_size:
            mbs = self.micro_batch_size
            if gbs % (mbs * dp_size) != 0:
                fail(
                    f"--global-batch-size {gbs} with --micro-batch-size {mbs} on {dp_size} data-parallel ranks",
                    "every data-parallel rank must run a whole number of micro-batches per step",
                    f"make --global-batch-size a multiple of micro-batch-size x DP = {mbs * dp_size}",
                )
