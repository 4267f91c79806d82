"""RolloutConfig: the rollout manager's settings (prompts, group sizes, evaluation) and the flags of
the data; the engine, rewards, custom generation and dynamic sampling are declared beside it
(``engine.py``, ``rewards.py``, ``custom_generation.py``, ``dynamic_sampling.py``) and carried here
under their flag names (slime's filters and hooks read them on the object passed as ``args``)."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

from rl_plugin.configs._checks import positive
from rl_plugin.configs.batching import BatchingConfig
from rl_plugin.configs.custom_generation import CustomGenerationConfig
from rl_plugin.configs.dynamic_sampling import DynamicSamplingConfig as Dyn
from rl_plugin.configs.engine import EngineConfig
from rl_plugin.configs.model import ModelConfig
from rl_plugin.configs.multimodal import MultimodalConfig
from rl_plugin.configs.rewards import RewardConfig
from rl_plugin.errors import fail
from rl_plugin.flags import Declared, derived, flag, nested, same_as
from rl_plugin.loss_config import LossConfig

# Arguments rl_plugin itself passes to apply_chat_template: a kwarg of the same name would clash.
RESERVED_CHAT_TEMPLATE_KWARGS = ("conversation", "add_generation_prompt", "tokenize", "return_dict", "return_tensors")


def parse_chat_template_kwargs(value: str) -> dict:
    """argparse ``type`` of ``--apply-chat-template-kwargs``: a JSON object, checked at parse time."""
    try:
        out = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not valid JSON ({exc.msg} at character {exc.pos}). Fix: pass a JSON object, e.g. "
            "'{\"enable_thinking\": false}' (JSON spells the booleans true/false, and keys need double quotes)"
        ) from None
    if not isinstance(out, dict):
        raise argparse.ArgumentTypeError(
            f"{value!r} is a JSON {type(out).__name__}, not an object. Fix: pass an object, e.g. '{{\"enable_thinking\": false}}'"
        )
    clash = [k for k in RESERVED_CHAT_TEMPLATE_KWARGS if k in out]
    if clash:
        raise argparse.ArgumentTypeError(
            f"{', '.join(clash)} is set by rl_plugin itself (the generation prompt is always added and the ids returned). "
            "Fix: drop it from the object"
        )
    return out


def _penalty(args) -> float:
    factor = args.overlong_penalty_factor
    return 1.0 if factor is None else float(factor)  # DAPO's default, used only with --overlong-buffer-len


@dataclass(frozen=True)
class RolloutConfig(Declared):
    """The rollout manager's settings. slime's dynamic-sampling filters are called as
    ``fn(args, samples)``; they receive this object (it carries slime's names)."""

    engine: EngineConfig = nested(EngineConfig)
    multimodal: MultimodalConfig = nested(MultimodalConfig)  # --multimodal-keys, --min/max-pixels
    prompt_data: Optional[str] = flag(
        "--prompt-data",
        type=str,
        default=None,
        group="rollout",
        help="Training prompts: a JSONL file (one JSON object per line) or a .parquet file (one row per prompt). Omit it (and --hf-checkpoint) to run the embedded default: a tiny model on a synthetic digit-copy task that learns on a CPU in minutes.",
    )
    input_key: str = flag(
        "--input-key",
        type=str,
        default="prompt",
        group="rollout",
        help='Key of the prompt in each --prompt-data record: a string, or a list of chat messages [{"role": "system", "content": ...}, {"role": "user", "content": ...}] (slime\'s and verl\'s convention; needs --apply-chat-template).',
    )
    label_key: str = flag(
        "--label-key",
        type=str,
        default="label",
        group="rollout",
        help="Key of the reference answer the reward function checks against.",
    )
    apply_chat_template: bool = flag(
        "--apply-chat-template",
        action="store_true",
        group="rollout",
        help="Wrap each prompt in the tokenizer's chat template (a string becomes a user turn; a message list is used as it is) and add the generation prompt. Use with instruction-tuned checkpoints.",
    )
    apply_chat_template_kwargs: Optional[Dict[str, Any]] = flag(
        "--apply-chat-template-kwargs",
        type=parse_chat_template_kwargs,
        default=None,
        group="rollout",
        help="JSON object of extra arguments for the chat template (slime's flag), e.g. '{\"enable_thinking\": false}' for Qwen3 without its thinking block. Needs --apply-chat-template.",
    )
    system_prompt: Optional[str] = flag(
        "--system-prompt",
        type=str,
        default=None,
        group="rollout",
        help="A system turn put before every prompt's messages by the chat template (a message list that already begins with a system turn keeps its own). Needs --apply-chat-template. slime has no such flag (its datasets carry the system turn in the messages); both work here.",
    )
    metadata_key: Optional[str] = flag(
        "--metadata-key",
        type=str,
        default=None,
        group="rollout",
        help="Key of a per-prompt JSON object (e.g. the test cases of a code task) handed to the reward function: a --custom-rm-path function that takes a `metadata` keyword is called as fn(prompt, response, label, metadata=...). slime's flag; unset, no metadata is read.",
    )
    rollout_shuffle: bool = flag(
        "--rollout-shuffle",
        action="store_true",
        group="rollout",
        help="Shuffle the prompts at every epoch (seeded by --seed and the epoch, so resume is exact).",
    )
    # declared with batching: a rollout's groups are also what its steps split
    rollout_batch_size: Optional[int] = same_as(BatchingConfig, "rollout_batch_size")
    n_samples_per_prompt: int = same_as(BatchingConfig, "n_samples_per_prompt")
    num_rollout: Optional[int] = flag(  # required with --prompt-data; the embedded run sets it
        "--num-rollout",
        type=int,
        default=None,
        group="rollout",
        help="Number of rollouts (generate -> train -> weight sync) to run. Default: 300 for the embedded task, else required.",
    )
    eval_interval: Optional[int] = flag(
        "--eval-interval",
        type=int,
        default=None,
        group="rollout",
        help="Evaluate on the held-out prompts (--eval-prompt-data) every N rollouts, and after the last one.",
    )
    eval_prompt_data: Optional[str] = flag(
        "--eval-prompt-data",
        type=str,
        default=None,
        group="rollout",
        help="Held-out prompts for --eval-interval, JSONL or .parquet (same keys as --prompt-data). The embedded task writes its own.",
    )
    n_samples_per_eval: int = flag(
        "--n-samples-per-eval",
        "--n-samples-per-eval-prompt",
        type=int,
        default=1,
        group="rollout",
        help="Responses sampled per evaluation prompt (slime spells it --n-samples-per-eval-prompt; both are accepted).",
    )
    rm_type: Optional[str] = same_as(RewardConfig, "rm_type")
    custom_rm_path: Optional[str] = same_as(RewardConfig, "custom_rm_path")
    group_rm: bool = same_as(RewardConfig, "group_rm")
    reward_key: Optional[str] = same_as(RewardConfig, "reward_key")
    rm_url: Optional[str] = same_as(RewardConfig, "rm_url")  # the three below: None = remote_rm's defaults
    rm_max_concurrency: Optional[int] = same_as(RewardConfig, "rm_max_concurrency")
    rm_timeout: Optional[float] = same_as(RewardConfig, "rm_timeout")
    rm_max_retries: Optional[int] = same_as(RewardConfig, "rm_max_retries")
    dynamic_sampling_filter_path: Optional[str] = same_as(Dyn, "dynamic_sampling_filter_path")
    dynamic_sampling_max_rounds: int = same_as(Dyn, "dynamic_sampling_max_rounds")
    over_sampling_batch_size: Optional[int] = same_as(Dyn, "over_sampling_batch_size")
    overlong_buffer_len: Optional[int] = same_as(Dyn, "overlong_buffer_len")
    overlong_penalty_factor: float = derived(_penalty, 1.0)  # --overlong-penalty-factor, resolved
    debug_rollout_logprob_shift: float = flag(
        "--debug-rollout-logprob-shift",
        type=float,
        default=0.0,
        group="engine",
        help="Testing and debugging only: subtract d from every log-prob the engine returns, i.e. simulate an engine whose sampling policy disagrees with the trainer by log pi_old - log pi_rollout = d on every token, so the TIS weight (exp(d), then clipped) and the mismatch metrics (|d|, e^d - 1 - d) are known exactly. Never use it in training.",
    )
    seed: int = same_as(ModelConfig, "seed")
    use_opd: bool = same_as(LossConfig, "use_opd")  # --use-opd: an engine-served teacher scores here (hf / vllm)
    opd_type: str = same_as(LossConfig, "opd_type")
    opd_teacher_load: Optional[str] = same_as(LossConfig, "opd_teacher_load")
    opd_teacher_max_tokens: int = same_as(LossConfig, "opd_teacher_max_tokens")
    opd_teacher_gpu_memory_utilization: float = same_as(LossConfig, "opd_teacher_gpu_memory_utilization")
    custom_generate_function_path: Optional[str] = same_as(CustomGenerationConfig, "custom_generate_function_path")
    rollout_function_path: Optional[str] = same_as(CustomGenerationConfig, "rollout_function_path")
    custom_generate_timeout: float = same_as(CustomGenerationConfig, "custom_generate_timeout")
    rollout_function_timeout: float = same_as(CustomGenerationConfig, "rollout_function_timeout")
    custom_agent_function_path: Optional[str] = same_as(CustomGenerationConfig, "custom_agent_function_path")
    agent_timeout: float = same_as(CustomGenerationConfig, "agent_timeout")

    @property
    def rollout_max_response_len(self) -> Optional[int]:  # slime's name, for filters written against slime's args
        return self.engine.max_response_len

    def check(self, run) -> None:
        for name, value in (
            ("--rollout-batch-size", self.rollout_batch_size),
            ("--num-rollout", self.num_rollout),
            ("--eval-interval", self.eval_interval),
            ("--n-samples-per-eval", self.n_samples_per_eval),
        ):
            positive(name, value)
        if self.prompt_data is not None:
            self._check_custom_data(run)
        for name, value in (
            ("--apply-chat-template-kwargs", self.apply_chat_template_kwargs),
            ("--system-prompt", self.system_prompt),
        ):
            if value is not None and not self.apply_chat_template:
                fail(
                    f"{name} without --apply-chat-template",
                    "it is an input of the chat template, which is off, so it would be silently ignored",
                    "add --apply-chat-template (for an instruction-tuned checkpoint), or drop the flag",
                )
        if self.eval_interval is not None and self.prompt_data is not None and self.eval_prompt_data is None:
            fail(
                "--eval-interval without --eval-prompt-data",
                "evaluation needs held-out prompts",
                "pass --eval-prompt-data FILE.jsonl, or drop --eval-interval",
            )
        self._check_debug_shift(run)

    def _check_custom_data(self, run) -> None:
        """A ``--prompt-data`` run names its sizes and its reward (the embedded task has defaults)."""
        sft = not run.mode.generates  # trains on the data's own answers: nothing sampled, no reward
        sizes = (
            ("--rollout-batch-size", self.rollout_batch_size),
            ("--rollout-max-response-len", 0 if sft else self.engine.max_response_len),
            ("--num-rollout", self.num_rollout),
        )
        missing = [f for f, v in sizes if v is None]
        if missing:
            fail(
                f"--prompt-data without {', '.join(missing)}",
                "a custom dataset has no embedded defaults for the rollout size",
                f"pass {' '.join(m + ' N' for m in missing)}",
            )
        agent = run.custom_generation.custom_agent_function_path  # its reward may be the agent's number
        if not (run.rewards.rm_type or run.rewards.custom_rm_path or sft or agent):
            fail(
                "--prompt-data without --rm-type or --custom-rm-path",
                "a custom dataset needs a reward function",
                "pass --rm-type math_exact or --custom-rm-path module:function",
            )

    def _check_debug_shift(self, run) -> None:
        d = self.debug_rollout_logprob_shift
        if not math.isfinite(d):
            fail(
                "--debug-rollout-logprob-shift",
                f"must be a finite number (got {d})",
                "use e.g. 0.5, or drop the flag (it is for tests only)",
            )
        if d != 0 and run.train.use_rollout_logprobs:
            fail(
                "--debug-rollout-logprob-shift with --use-rollout-logprobs",
                "the shifted engine log-probs would become the old log-probs and the shift would be trained on, not measured",
                "drop --use-rollout-logprobs",
            )
