"""TrainConfig: everything one training process needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rl_plugin.configs.batching import BatchingConfig
from rl_plugin.configs.model import ModelConfig
from rl_plugin.configs.optimizer import OptimizerConfig
from rl_plugin.loss import LossConfig


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training process needs (``TrainBackend.from_config``, ``TrainActor.init``)."""

    train_backend: str = "megatron"
    model: ModelConfig = ModelConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    batching: BatchingConfig = BatchingConfig()
    loss: LossConfig = LossConfig()
    use_rollout_logprobs: bool = False  # old log-probs = the engine's (no recompute pass)
    routing_replay: Optional[str] = None  # "rollout" (R3) | "old" (R2) | None (rl_plugin.routing.mode)

    @classmethod
    def from_args(cls, args) -> "TrainConfig":
        from rl_plugin.routing.mode import routing_replay_mode

        return cls(
            routing_replay=routing_replay_mode(args),
            train_backend=args.train_backend,
            model=ModelConfig.from_args(args),
            optimizer=OptimizerConfig.from_args(args),
            batching=BatchingConfig.from_args(args),
            loss=LossConfig.from_args(args),
            use_rollout_logprobs=bool(args.use_rollout_logprobs),
        )
