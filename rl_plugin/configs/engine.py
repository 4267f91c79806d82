"""EngineConfig: the generation engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class EngineConfig:
    engine: str = "hf"
    temperature: float = 1.0
    top_p: float = 1.0
    max_response_len: Optional[int] = None  # required with --prompt-data; the embedded run sets it
    tensor_parallel_size: int = 1  # --rollout-num-gpus-per-engine
    seed: int = 1234
    record_routed_experts: bool = False  # --use-rollout-routing-replay: the engine records each token's experts
    debug_routing_flip: float = 0.0  # --debug-engine-routing-flip (hf engine test hook)

    @classmethod
    def from_args(cls, args) -> "EngineConfig":
        return cls(
            engine=args.rollout_engine,
            temperature=float(args.rollout_temperature),
            top_p=float(args.rollout_top_p),
            max_response_len=args.rollout_max_response_len,
            tensor_parallel_size=int(args.rollout_num_gpus_per_engine),
            seed=int(args.seed),
            record_routed_experts=bool(args.use_rollout_routing_replay),
            debug_routing_flip=float(args.debug_engine_routing_flip),
        )
