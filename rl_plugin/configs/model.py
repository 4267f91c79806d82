"""ModelConfig (what to build: checkpoint, precision, LM head, parallel layout, seed) and its MoEConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rl_plugin.configs.megatron import MEGATRON
from rl_plugin.flags import flag


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts settings (``rl_plugin.arguments.moe``; ignored by dense models)."""

    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None  # None: the TP size (Megatron-LM)
    router_load_balancing_type: str = "aux_loss"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: Optional[float] = None
    token_dispatcher_type: str = "alltoall"
    router_dtype: Optional[str] = None

    @classmethod
    def from_args(cls, args) -> "MoEConfig":
        return cls(
            expert_model_parallel_size=int(args.expert_model_parallel_size),
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
            router_load_balancing_type=args.moe_router_load_balancing_type,
            aux_loss_coeff=float(args.moe_aux_loss_coeff),
            z_loss_coeff=args.moe_z_loss_coeff,
            token_dispatcher_type=args.moe_token_dispatcher_type,
            router_dtype=args.moe_router_dtype,
        )


@dataclass(frozen=True)
class ModelConfig:
    hf_checkpoint: Optional[str] = None  # None: the embedded tiny model
    save_hf: Optional[str] = None
    bf16: bool = False
    fp16: bool = False
    fp32_lm_head: bool = False
    fused_lm_head: bool = True  # not --disable-fused-lm-head
    attn_implementation: str = "sdpa"  # --fsdp-attn-implementation (the FSDP backend's HF attention)
    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # the interleaved schedule (one of the two Megatron-LM flags; None: one chunk per stage)
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    num_virtual_stages_per_pipeline_rank: Optional[int] = None
    sequence_parallel: bool = False
    seed: int = flag(
        "--seed",
        type=int,
        default=1234,
        help="Random seed for Python, NumPy and torch (Megatron-LM default 1234).",
        **MEGATRON,
    )
    moe: MoEConfig = MoEConfig()

    @classmethod
    def from_args(cls, args) -> "ModelConfig":
        return cls(
            hf_checkpoint=args.hf_checkpoint,
            save_hf=args.save_hf,
            bf16=bool(args.bf16),
            fp16=bool(args.fp16),
            fp32_lm_head=bool(args.fp32_lm_head),
            fused_lm_head=not args.disable_fused_lm_head,
            attn_implementation=args.fsdp_attn_implementation,
            tensor_model_parallel_size=int(args.tensor_model_parallel_size),
            context_parallel_size=int(args.context_parallel_size),
            pipeline_model_parallel_size=int(args.pipeline_model_parallel_size),
            num_layers_per_virtual_pipeline_stage=getattr(args, "num_layers_per_virtual_pipeline_stage", None),
            num_virtual_stages_per_pipeline_rank=getattr(args, "num_virtual_stages_per_pipeline_rank", None),
            sequence_parallel=bool(args.sequence_parallel),
            seed=int(args.seed),
            moe=MoEConfig.from_args(args),
        )
