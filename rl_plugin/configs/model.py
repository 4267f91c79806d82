"""ModelConfig (what to build: checkpoint, precision, LM head, parallel layout, seed) and its MoEConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rl_plugin.errors import fail
from rl_plugin.flags import MEGATRON, Bounds, Declared, derived, flag, nested, option

LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
DISPATCHERS = ("alltoall", "allgather")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
# Megatron-LM's MoE flags, in their own --help section: added by ``add_rl_arguments`` unless the parser
# (Megatron-LM's) already defines them, as before they were declared here
MOE = dict(group="moe")


@dataclass(frozen=True)
class MoEConfig(Declared):
    """Mixture-of-experts settings (ignored by dense models), spelled and defaulted as Megatron-LM
    spells them (Megatron-LM's own definitions are read when its parser is in use).

    Expert parallelism (``--expert-model-parallel-size``, Megatron backend) places each MoE layer's
    experts on EP ranks carved out of the data-parallel ranks: the world must be a multiple of
    TP x EP (with expert-TP 1) and the experts a multiple of EP (``arguments.model_layout`` checks
    the checkpoint). The router and aux-loss flags set megatron-core's ``TransformerConfig``; the
    FSDP backend adds the same aux (``aux_loss`` type) and z losses to the HF MoE model
    (``backends/fsdp/router_losses.py``) and refuses expert parallelism and the router dtype."""

    expert_model_parallel_size: int = flag(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="Expert parallelism (Megatron backend): each MoE layer's experts split over this many ranks, carved out of the data-parallel ranks (Megatron-LM). Must divide the number of experts and the world / TP.",
        **MOE,
    )
    expert_tensor_parallel_size: Optional[int] = flag(  # None: the TP size (Megatron-LM)
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        help="Tensor parallelism inside each expert (Megatron-LM; default: --tensor-model-parallel-size). rl_plugin supports 1 or the TP size; an MoE model under TP > 1 needs --sequence-parallel (transformer-engine).",
        **MOE,
    )
    router_load_balancing_type: str = flag(
        "--moe-router-load-balancing-type",
        choices=LOAD_BALANCING,
        default="aux_loss",
        help="Router load balancing (Megatron-LM): aux_loss (Switch-style, per micro-batch), seq_aux_loss (per sequence), global_aux_loss, sinkhorn, none. With --moe-aux-loss-coeff 0 the aux losses cost nothing.",
        **MOE,
    )
    aux_loss_coeff: float = flag(
        "--moe-aux-loss-coeff",
        type=float,
        default=0.0,
        help="Coefficient of the load-balancing loss added to the objective (Megatron-LM; 0 = off). Both backends (FSDP: the aux_loss type only).",
        **MOE,
    )
    z_loss_coeff: Optional[float] = flag(
        "--moe-z-loss-coeff",
        type=float,
        default=None,
        help="Coefficient of the router z-loss (mean squared logsumexp of the router logits; Megatron-LM; default off). Both backends.",
        **MOE,
    )
    token_dispatcher_type: str = flag(
        "--moe-token-dispatcher-type",
        choices=DISPATCHERS,
        default="alltoall",
        help="megatron-core's token dispatcher (Megatron-LM's default is allgather; RL recipes use alltoall). Both run over gloo on CPU; allgather only at --expert-model-parallel-size 1 (it gathers equal token counts from every EP rank, and RL micro-batches differ in length).",
        **MOE,
    )
    router_dtype: Optional[str] = flag(
        "--moe-router-dtype",
        choices=["fp32", "fp64"],
        default=None,
        help="Router compute dtype (Megatron-LM; default: the model's). fp32 keeps a bf16 model's routing stable.",
        **MOE,
    )

    def check(self, run) -> None:
        ep = self.expert_model_parallel_size
        etp = self.expert_tensor_parallel_size
        if ep < 1:
            fail(f"--expert-model-parallel-size {ep}", "must be >= 1", "use --expert-model-parallel-size 1")
        if etp is not None and etp < 1:
            fail(f"--expert-tensor-parallel-size {etp}", "must be >= 1", "drop the flag (it defaults to the TP size)")
        for name, value in (
            ("--moe-aux-loss-coeff", self.aux_loss_coeff),
            ("--moe-z-loss-coeff", self.z_loss_coeff),
        ):
            if value is not None and not value >= 0:
                fail(f"{name} {value}", "a loss coefficient must be >= 0", f"use e.g. {name} 0.001")
        if run.train.train_backend == "fsdp":
            self._check_fsdp()
            return
        tp = run.train.model.tensor_model_parallel_size
        if etp not in (None, 1, tp):
            fail(
                f"--expert-tensor-parallel-size {etp} with --tensor-model-parallel-size {tp}",
                "rl_plugin's Megatron backend loads and exports experts that are whole (1) or split like the dense layers",
                f"use --expert-tensor-parallel-size 1 or {tp}",
            )
        if ep > 1 and self.token_dispatcher_type == "allgather":
            fail(
                f"--moe-token-dispatcher-type allgather with --expert-model-parallel-size {ep}",
                "the allgather dispatcher gathers the same number of tokens from every rank of an expert-parallel "
                "group, and RL micro-batches differ in length across the data-parallel ranks EP spans (megatron-core "
                "refuses it with variable sequence lengths)",
                "use --moe-token-dispatcher-type alltoall (the default), or --expert-model-parallel-size 1",
            )
        world = run.cluster.world_size
        pp = run.train.model.pipeline_model_parallel_size
        if ep > 1 and (world // pp) % ((etp or tp) * ep):
            fail(
                f"--expert-model-parallel-size {ep} with {world} training processes",
                f"megatron-core needs the world / PP ({world // pp}) to be a multiple of expert-TP ({etp or tp}) x EP ({ep})",
                "launch more training processes or lower --expert-model-parallel-size",
            )

    def _check_fsdp(self) -> None:
        for name, value, default in (
            ("--expert-model-parallel-size", self.expert_model_parallel_size, 1),
            ("--expert-tensor-parallel-size", self.expert_tensor_parallel_size, None),
            ("--moe-router-dtype", self.router_dtype, None),
        ):
            if value != default:
                fail(
                    f"--train-backend fsdp with {name} {value}",
                    "the FSDP backend runs the Hugging Face MoE layer as it is (experts sharded by FSDP, no expert "
                    "parallelism, the model's router dtype)",
                    f"drop {name} or use --train-backend megatron",
                )
        kind = self.router_load_balancing_type
        if self.aux_loss_coeff > 0 and kind != "aux_loss":
            fail(
                f"--train-backend fsdp with --moe-router-load-balancing-type {kind} --moe-aux-loss-coeff "
                f"{self.aux_loss_coeff}",
                "the FSDP backend computes Megatron-LM's per-micro-batch aux_loss only",
                "use --moe-router-load-balancing-type aux_loss, or --train-backend megatron",
            )


@dataclass(frozen=True)
class ModelConfig(Declared):
    """What to build: the checkpoint, precision, LM head, parallel layout and seed (TP/CP/PP/SP,
    precision and seed are Megatron-LM's flags, declared here)."""

    hf_checkpoint: Optional[str] = flag(  # None: the embedded tiny model
        "--hf-checkpoint",
        type=str,
        default=None,
        help="Hugging Face checkpoint directory (config.json + safetensors) to start from. Both backends load it; the Megatron backend converts it with mbridge (dense llama, mistral, qwen2, qwen3), fsdp takes any AutoModelForCausalLM; another model is refused at start-up. Default: the embedded tiny model.",
        group="training backend",
    )
    save_hf: Optional[str] = flag(
        "--save-hf",
        type=str,
        default=None,
        help=(
            "Write the trained weights as a Hugging Face directory (safetensors, config and tokenizer files) here at "
            "every save (--save), or once at the end of the run when there is no --save. With --lora-rank: the PEFT "
            "adapter directory (the merged model: --save-hf-merged)."
        ),
        group="training backend",
    )
    tensor_model_parallel_size: int = flag(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="Tensor (vocab/hidden) parallel size (Megatron-LM).",
        bounds=Bounds(1, "--tensor-model-parallel-size 1"),
        **MEGATRON,
    )
    pipeline_model_parallel_size: int = flag(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help=(
            "Pipeline parallel size (Megatron-LM): the layers split evenly over this many stages, trained "
            "through megatron-core's 1F1B schedule with the loss on the last stage (--train-backend megatron)."
        ),
        bounds=Bounds(1, "--pipeline-model-parallel-size 1"),
        **MEGATRON,
    )
    # the interleaved schedule (one of the two Megatron-LM flags; None: one chunk per stage)
    num_layers_per_virtual_pipeline_stage: Optional[int] = flag(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help=(
            "Interleaved (virtual) pipeline schedule (Megatron-LM): each pipeline rank holds several model chunks of "
            "this many layers (layers / (--pipeline-model-parallel-size x N) chunks per rank); needs "
            "--pipeline-model-parallel-size > 1. Mutually exclusive with --num-virtual-stages-per-pipeline-rank."
        ),
        bounds=Bounds(1, "--num-layers-per-virtual-pipeline-stage 2"),
        **MEGATRON,
    )
    num_virtual_stages_per_pipeline_rank: Optional[int] = flag(
        "--num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        help=(
            "Interleaved (virtual) pipeline schedule (Megatron-LM): the number of model chunks each pipeline rank "
            "holds (the layers split evenly over --pipeline-model-parallel-size x this many chunks); needs "
            "--pipeline-model-parallel-size > 1."
        ),
        bounds=Bounds(1, "--num-virtual-stages-per-pipeline-rank 2"),
        **MEGATRON,
    )
    context_parallel_size: int = flag(
        "--context-parallel-size",
        type=int,
        default=1,
        help="Context parallel size: each sequence is cut into 2*cp zigzag chunks (Megatron-LM). Needs transformer-engine attention on the Megatron backend.",
        bounds=Bounds(1, "--context-parallel-size 1"),
        **MEGATRON,
    )
    sequence_parallel: bool = flag(
        "--sequence-parallel", action="store_true", help="Megatron sequence parallelism over the TP group.", **MEGATRON
    )
    bf16: bool = flag(
        "--bf16",
        action="store_true",
        help="Train in bfloat16 with fp32 main parameters and gradients (Megatron-LM).",
        **MEGATRON,
    )
    fp16: bool = flag(
        "--fp16", action="store_true", help="Train in float16 (Megatron-LM). Not recommended for RL.", **MEGATRON
    )
    seed: int = flag(
        "--seed",
        type=int,
        default=1234,
        help="Random seed for Python, NumPy and torch (Megatron-LM default 1234).",
        **MEGATRON,
    )
    fp32_lm_head: bool = flag(
        "--fp32-lm-head",
        action="store_true",
        help="Compute the output projection with fp32 accumulation and fp32 logits (gradient into the bf16 weight). Use with --bf16: bf16 logits lose ~3 digits of log-prob precision and bias the importance ratio.",
        group="log-probs",
    )
    fused_lm_head: bool = derived(
        lambda args: not args.disable_fused_lm_head,
        True,
        inputs=[
            option(
                "--disable-fused-lm-head",
                action="store_true",
                help="Build the [tokens, vocab/tp] logits and take log-probs from them, instead of the default fused output projection + log-softmax that never holds them (the head is recomputed chunk by chunk in the backward; cf. Liger's fused linear cross-entropy and Wijmans et al. 2024, Cut Your Losses in Large-Vocabulary Language Models, arXiv:2411.09009). Use to compare against the unfused path; models the fused head cannot stand in for (an output bias, logit soft-capping or scaling, multi-token prediction) use the unfused path anyway.",
                group="log-probs",
            )
        ],
    )
    attn_implementation: str = flag(  # the FSDP backend's HF attention
        "--fsdp-attn-implementation",
        choices=ATTN_IMPLEMENTATIONS,
        default="sdpa",
        help="Hugging Face attention implementation of the FSDP backend. sdpa / eager isolate packed samples with a block-diagonal causal mask (T x T per micro-batch, fine on CPU and for short packs); flash_attention_2/3 (GPU, needs flash-attn) split packed samples by position-id resets with varlen kernels and no mask: use them for long packed micro-batches.",
        group="fsdp backend",
    )
    moe: MoEConfig = nested(MoEConfig)

    @property
    def model_parallel_size(self) -> int:
        """TP x CP x PP: the ranks one model replica spans (the world is a multiple of it)."""
        return self.tensor_model_parallel_size * self.context_parallel_size * self.pipeline_model_parallel_size

    def check(self, run) -> None:
        """The interleaved schedule's flags: one of the two, and only with pipeline stages to
        interleave (the layer count is checked against the model in ``arguments.model_layout``)."""
        per_stage = self.num_layers_per_virtual_pipeline_stage
        per_rank = self.num_virtual_stages_per_pipeline_rank
        if per_stage is not None and per_rank is not None:
            fail(
                f"--num-layers-per-virtual-pipeline-stage {per_stage} with --num-virtual-stages-per-pipeline-rank {per_rank}",
                "both size the model chunks of the interleaved schedule",
                "pass only one of them",
            )
        pp = self.pipeline_model_parallel_size or 1
        name = (
            "--num-layers-per-virtual-pipeline-stage"
            if per_stage is not None
            else "--num-virtual-stages-per-pipeline-rank"
        )
        value = per_stage if per_stage is not None else per_rank
        if value is not None and pp < 2:
            fail(
                f"{name} {value} with --pipeline-model-parallel-size {pp}",
                "the interleaved schedule interleaves model chunks over pipeline stages, and there is one stage",
                f"add --pipeline-model-parallel-size 2 (or more), or drop {name}",
            )
