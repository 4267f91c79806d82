"""Typed configs below the command line: built once from the validated flags, read everywhere below.

The loop parses and validates the flags (``rl_plugin.arguments``), then builds these once;
backends, train actors and the rollout side receive them and never see the ``Namespace``. Every
value comes from the parser, whose defaults are the only defaults (no ``getattr(args, name,
default)`` below the CLI); a value derived from several flags is computed here, once.

- ``ModelConfig``: what to build: ``--hf-checkpoint``, precision, LM head, attention, TP/CP/PP/SP, seed,
  ``MoEConfig`` (EP, expert-TP, router / aux-loss flags)
- ``OptimizerConfig``: ``--optimizer``, the learning-rate schedule, Adam/SGD settings, ``--clip-grad``
- ``BatchingConfig``: micro-batches (``--micro-batch-size`` or the token budget), step sizes
- ``LossConfig``: the loss core's settings (``rl_plugin.loss.config``)
- ``TrainConfig``: one training process: the four above, ``--train-backend``, ``--use-rollout-logprobs``,
  the routing replay mode (``--use-rollout-routing-replay`` / ``--use-routing-replay``)
- ``EngineConfig``: the generation engine: ``--rollout-engine``, sampling, engine TP, seed
- ``RolloutConfig``: the rollout manager: data, rewards, group sizes, dynamic sampling, shaping

``TrainConfig.from_args`` loads user functions named by flags (custom reducer, custom TIS) once,
in the process that builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from rl_plugin.errors import fail
from rl_plugin.flags import Bounds, Declared, flag
from rl_plugin.loss import LossConfig
from rl_plugin.registries import DYNAMIC_SAMPLING_MAX_ROUNDS

MEGATRON = dict(group="megatron", megatron=True)  # Megatron-LM's own flags


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
    seed: int = 1234
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


@dataclass(frozen=True)
class OptimizerConfig(Declared):
    """The optimizer and its learning-rate schedule (Megatron-LM's flags, spelled and defaulted as
    Megatron-LM does; declared here, added to our parser only when Megatron-LM's is absent)."""

    optimizer: str = flag(
        "--optimizer",
        choices=["adam", "sgd"],
        default="adam",
        help="Optimizer (Megatron-LM). adam (AdamW with --weight-decay) for training; sgd makes the update linear in the gradient (parity tests, debugging).",
        **MEGATRON,
    )
    lr: float = flag(
        "--lr",
        type=float,
        default=1e-6,
        help="Peak learning rate (Megatron-LM).",
        bounds=Bounds(0.0, "--lr 1e-6"),
        **MEGATRON,
    )
    min_lr: float = flag(
        "--min-lr",
        type=float,
        default=0.0,
        help="Minimum learning rate of the decay schedule (Megatron-LM).",
        bounds=Bounds(0.0, "--min-lr 0"),
        **MEGATRON,
    )
    lr_decay_style: str = flag(
        "--lr-decay-style",
        choices=["constant", "linear", "cosine", "inverse-square-root"],
        default="constant",
        help="Learning-rate decay (Megatron-LM). RL recipes mostly use constant.",
        **MEGATRON,
    )
    lr_warmup_iters: int = flag(
        "--lr-warmup-iters",
        type=int,
        default=0,
        help="Linear warm-up steps (Megatron-LM).",
        bounds=Bounds(0, "--lr-warmup-iters 0"),
        **MEGATRON,
    )
    lr_decay_iters: Optional[int] = flag(  # required (checked) unless constant
        "--lr-decay-iters",
        type=int,
        default=None,
        help="Steps over which the learning rate decays (Megatron-LM).",
        bounds=Bounds(1, "--lr-decay-iters 1000"),
        **MEGATRON,
    )
    weight_decay: float = flag(
        "--weight-decay",
        type=float,
        default=0.0,
        help="Decoupled weight decay (AdamW) (Megatron-LM).",
        bounds=Bounds(0.0, "--weight-decay 0.01"),
        **MEGATRON,
    )
    sgd_momentum: float = flag(
        "--sgd-momentum",
        type=float,
        default=0.9,
        help="SGD momentum with --optimizer sgd (Megatron-LM default 0.9).",
        bounds=Bounds(0.0, "--sgd-momentum 0.9", high=1.0),
        **MEGATRON,
    )
    adam_beta1: float = flag(
        "--adam-beta1",
        type=float,
        default=0.9,
        help="Adam beta1 (Megatron-LM).",
        bounds=Bounds(0.0, "--adam-beta1 0.9", high=1.0),
        **MEGATRON,
    )
    adam_beta2: float = flag(
        "--adam-beta2",
        type=float,
        default=0.98,
        help="Adam beta2 (Megatron-LM; RL recipes use 0.98).",
        bounds=Bounds(0.0, "--adam-beta2 0.98", high=1.0),
        **MEGATRON,
    )
    adam_eps: float = flag(
        "--adam-eps",
        type=float,
        default=1e-8,
        help="Adam epsilon (Megatron-LM).",
        bounds=Bounds(0.0, "--adam-eps 1e-8", low_open=True),
        **MEGATRON,
    )
    clip_grad: float = flag(
        "--clip-grad",
        type=float,
        default=1.0,
        help="Global gradient-norm clip; 0 disables (Megatron-LM).",
        bounds=Bounds(0.0, "--clip-grad 1.0 (0 disables clipping)"),
        **MEGATRON,
    )
    use_distributed_optimizer: bool = flag(  # ZeRO-1 over DP (Megatron backend)
        "--use-distributed-optimizer",
        action="store_true",
        help="Shard optimizer state over data-parallel ranks (Megatron-LM, ZeRO-1).",
        **MEGATRON,
    )

    @classmethod
    def check(cls, args) -> None:
        lr, min_lr = getattr(args, "lr", None), getattr(args, "min_lr", None)
        if lr is not None and min_lr is not None and min_lr > lr:
            fail(
                f"--min-lr {min_lr} with --lr {lr}",
                "the decay schedule ends at --min-lr, so it must not exceed the peak --lr",
                f"use --min-lr <= {lr}",
            )


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


__all__ = [
    "BatchingConfig",
    "EngineConfig",
    "LossConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RolloutConfig",
    "TrainConfig",
]
