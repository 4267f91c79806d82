"""BatchingConfig: micro-batches (by count or token budget) and the sizes of a step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class BatchingConfig:
    micro_batch_size: int = 1
    max_tokens_per_gpu: Optional[int] = None  # the token budget, set only with --use-dynamic-batch-size
    global_batch_size: Optional[int] = None
    docs_per_step: Optional[int] = None
    n_samples_per_prompt: int = 8
    rollout_batch_size: Optional[int] = None

    @classmethod
    def from_args(cls, args) -> "BatchingConfig":
        return cls(
            micro_batch_size=int(args.micro_batch_size),
            max_tokens_per_gpu=args.max_tokens_per_gpu if args.use_dynamic_batch_size else None,
            global_batch_size=args.global_batch_size,
            docs_per_step=args.docs_per_step,
            n_samples_per_prompt=int(args.n_samples_per_prompt),
            rollout_batch_size=args.rollout_batch_size,
        )
