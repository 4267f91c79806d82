"""LossConfig: the loss core's settings, resolved once from the parsed (and validated) flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from rl_plugin.loss.aggregation import load_custom_reducer
from rl_plugin.loss.offpolicy import load_custom_tis_function


@dataclass(frozen=True)
class LossConfig:
    loss_aggregation: str = "sample_mean"
    loss_aggregation_divisor: Optional[float] = None
    calculate_per_token_loss: bool = False
    policy_loss: str = "ppo_clip"
    eps_clip: float = 0.2
    eps_clip_high: Optional[float] = None
    eps_clip_c: Optional[float] = None
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    temperature: float = 1.0
    pg_metrics: str = "basic"
    custom_pg_reducer: Optional[Callable] = None
    qkv_format: str = "thd"
    max_seq_len: Optional[int] = None
    logprob_chunk_size: int = 1024
    # off-policy correction (offpolicy.py); the names match slime's args for custom TIS functions
    use_tis: bool = False
    tis_level: str = "token"
    tis_mode: str = "truncate"
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    custom_tis_function: Optional[Callable] = None
    # DeepSpeed parity (arguments/off_policy.py): backward objective x 1/N, reported J unchanged
    deepspeed_grad_scale: bool = False
    deepspeed_metric_names: bool = False

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef != 0.0 or self.pg_metrics == "with_entropy"

    @classmethod
    def from_args(cls, args) -> "LossConfig":
        """From an argparse namespace that went through ``validate_rl_args`` (every value from the
        parser, whose defaults are the only defaults; ``rl_plugin.configs.TrainConfig`` calls this)."""
        path = args.custom_pg_loss_reducer_function_path
        tis_path = args.custom_tis_function_path
        return cls(
            loss_aggregation=args.loss_aggregation,
            loss_aggregation_divisor=args.loss_aggregation_divisor,
            calculate_per_token_loss=bool(args.calculate_per_token_loss),
            policy_loss="gspo" if args.advantage_estimator == "gspo" else "ppo_clip",
            eps_clip=args.eps_clip,
            eps_clip_high=args.eps_clip_high,
            eps_clip_c=args.eps_clip_c,
            use_kl_loss=bool(args.use_kl_loss),
            kl_loss_coef=float(args.kl_loss_coef),
            kl_loss_type=args.kl_loss_type,
            entropy_coef=float(args.entropy_coef),
            temperature=float(args.rollout_temperature),
            pg_metrics=args.pg_metrics,
            custom_pg_reducer=load_custom_reducer(path) if path else None,
            qkv_format=args.qkv_format,
            max_seq_len=args.seq_length if args.qkv_format == "bshd" else None,
            logprob_chunk_size=int(args.log_probs_chunk_size),
            use_tis=bool(args.use_tis),
            tis_level=args.tis_level,
            tis_mode=args.tis_mode,
            tis_clip=float(args.tis_clip),
            tis_clip_low=float(args.tis_clip_low),
            custom_tis_function=load_custom_tis_function(tis_path) if tis_path else None,
            deepspeed_grad_scale=bool(args.deepspeed_grad_scale),
            deepspeed_metric_names=bool(args.deepspeed_metric_names),
        )
