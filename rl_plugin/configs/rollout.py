"""RolloutConfig: the rollout manager's settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from rl_plugin.configs.engine import EngineConfig
from rl_plugin.registries import DYNAMIC_SAMPLING_MAX_ROUNDS


@dataclass(frozen=True)
class RolloutConfig:
    """The rollout manager's settings. slime's dynamic-sampling filters are called as
    ``fn(args, samples)``; they receive this object (it carries slime's names)."""

    engine: EngineConfig = EngineConfig()
    input_key: str = "prompt"
    label_key: str = "label"
    apply_chat_template: bool = False
    apply_chat_template_kwargs: Optional[Dict[str, Any]] = None
    system_prompt: Optional[str] = None
    metadata_key: Optional[str] = None
    rollout_shuffle: bool = False
    rollout_batch_size: Optional[int] = None  # required with --prompt-data; the embedded run sets it
    n_samples_per_prompt: int = 8
    n_samples_per_eval: int = 1
    rm_type: Optional[str] = None
    custom_rm_path: Optional[str] = None
    group_rm: bool = False
    reward_key: Optional[str] = None
    rm_url: Optional[str] = None  # --rm-type remote_rm; the three below: None = remote_rm's defaults
    rm_max_concurrency: Optional[int] = None
    rm_timeout: Optional[float] = None
    rm_max_retries: Optional[int] = None
    dynamic_sampling_filter_path: Optional[str] = None
    dynamic_sampling_max_rounds: int = DYNAMIC_SAMPLING_MAX_ROUNDS
    over_sampling_batch_size: Optional[int] = None
    overlong_buffer_len: Optional[int] = None
    overlong_penalty_factor: float = 1.0  # DAPO's default, used only with overlong_buffer_len
    debug_rollout_logprob_shift: float = 0.0
    seed: int = 1234
    custom_generate_function_path: Optional[str] = None
    rollout_function_path: Optional[str] = None

    @property
    def rollout_max_response_len(self) -> Optional[int]:  # slime's name, for filters written against slime's args
        return self.engine.max_response_len

    @classmethod
    def from_args(cls, args) -> "RolloutConfig":
        factor = args.overlong_penalty_factor
        return cls(
            engine=EngineConfig.from_args(args),
            input_key=args.input_key,
            label_key=args.label_key,
            apply_chat_template=bool(args.apply_chat_template),
            apply_chat_template_kwargs=args.apply_chat_template_kwargs,
            system_prompt=args.system_prompt,
            metadata_key=args.metadata_key,
            rollout_shuffle=bool(args.rollout_shuffle),
            rollout_batch_size=args.rollout_batch_size,
            n_samples_per_prompt=int(args.n_samples_per_prompt),
            n_samples_per_eval=int(args.n_samples_per_eval),
            rm_type=args.rm_type,
            custom_rm_path=args.custom_rm_path,
            group_rm=bool(args.group_rm),
            reward_key=args.reward_key,
            rm_url=args.rm_url,
            rm_max_concurrency=args.rm_max_concurrency,
            rm_timeout=args.rm_timeout,
            rm_max_retries=args.rm_max_retries,
            dynamic_sampling_filter_path=args.dynamic_sampling_filter_path,
            dynamic_sampling_max_rounds=int(args.dynamic_sampling_max_rounds),
            over_sampling_batch_size=args.over_sampling_batch_size,
            overlong_buffer_len=args.overlong_buffer_len,
            overlong_penalty_factor=1.0 if factor is None else float(factor),
            debug_rollout_logprob_shift=float(args.debug_rollout_logprob_shift),
            seed=int(args.seed),
            custom_generate_function_path=getattr(args, "custom_generate_function_path", None),
            rollout_function_path=getattr(args, "rollout_function_path", None),
        )
