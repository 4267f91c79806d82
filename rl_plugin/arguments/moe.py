"""Mixture-of-experts flags, spelled and defaulted as Megatron-LM spells them (defined here only
when Megatron-LM's parser is absent; its own definitions are read otherwise).

Expert parallelism (``--expert-model-parallel-size``, Megatron backend) places each MoE layer's
experts on EP ranks carved out of the data-parallel ranks: the world must be a multiple of
TP x EP (with expert-TP 1) and the experts a multiple of EP (``model_layout`` checks the
checkpoint). The router and aux-loss flags set megatron-core's ``TransformerConfig``; the FSDP
backend adds the same aux (``aux_loss`` type) and z losses to the HF MoE model
(``backends/fsdp/router_losses.py``) and refuses expert parallelism and the router dtype.
"""

from __future__ import annotations

from rl_plugin.arguments._util import add_flag, fail

LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
DISPATCHERS = ("alltoall", "allgather")


def add_arguments(parser):
    g = parser.add_argument_group("moe", "Mixture-of-experts models (Megatron-LM spellings).")
    add_flag(
        g,
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="Expert parallelism (Megatron backend): each MoE layer's experts split over this many ranks, carved out of the data-parallel ranks (Megatron-LM). Must divide the number of experts and the world / TP.",
    )
    add_flag(
        g,
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        help="Tensor parallelism inside each expert (Megatron-LM; default: --tensor-model-parallel-size). rl_plugin supports 1 or the TP size.",
    )
    add_flag(
        g,
        "--moe-router-load-balancing-type",
        choices=LOAD_BALANCING,
        default="aux_loss",
        help="Router load balancing (Megatron-LM): aux_loss (Switch-style, per micro-batch), seq_aux_loss (per sequence), global_aux_loss, sinkhorn, none. With --moe-aux-loss-coeff 0 the aux losses cost nothing.",
    )
    add_flag(
        g,
        "--moe-aux-loss-coeff",
        type=float,
        default=0.0,
        help="Coefficient of the load-balancing loss added to the objective (Megatron-LM; 0 = off). Both backends (FSDP: the aux_loss type only).",
    )
    add_flag(
        g,
        "--moe-z-loss-coeff",
        type=float,
        default=None,
        help="Coefficient of the router z-loss (mean squared logsumexp of the router logits; Megatron-LM; default off). Both backends.",
    )
    add_flag(
        g,
        "--moe-token-dispatcher-type",
        choices=DISPATCHERS,
        default="alltoall",
        help="megatron-core's token dispatcher (Megatron-LM's default is allgather; RL recipes use alltoall). Both run over gloo on CPU.",
    )
    add_flag(
        g,
        "--moe-router-dtype",
        choices=["fp32", "fp64"],
        default=None,
        help="Router compute dtype (Megatron-LM; default: the model's). fp32 keeps a bf16 model's routing stable.",
    )
    return parser


def validate(args) -> None:
    ep = args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size
    if ep < 1:
        fail(f"--expert-model-parallel-size {ep}", "must be >= 1", "use --expert-model-parallel-size 1")
    if etp is not None and etp < 1:
        fail(f"--expert-tensor-parallel-size {etp}", "must be >= 1", "drop the flag (it defaults to the TP size)")
    for flag, value in (
        ("--moe-aux-loss-coeff", args.moe_aux_loss_coeff),
        ("--moe-z-loss-coeff", args.moe_z_loss_coeff),
    ):
        if value is not None and not value >= 0:
            fail(f"{flag} {value}", "a loss coefficient must be >= 0", f"use e.g. {flag} 0.001")
    if args.train_backend == "fsdp":
        for flag, value, default in (
            ("--expert-model-parallel-size", ep, 1),
            ("--expert-tensor-parallel-size", etp, None),
            ("--moe-router-dtype", args.moe_router_dtype, None),
        ):
            if value != default:
                fail(
                    f"--train-backend fsdp with {flag} {value}",
                    "the FSDP backend runs the Hugging Face MoE layer as it is (experts sharded by FSDP, no expert "
                    "parallelism, the model's router dtype)",
                    f"drop {flag} or use --train-backend megatron",
                )
        kind = args.moe_router_load_balancing_type
        if args.moe_aux_loss_coeff > 0 and kind != "aux_loss":
            fail(
                f"--train-backend fsdp with --moe-router-load-balancing-type {kind} --moe-aux-loss-coeff "
                f"{args.moe_aux_loss_coeff}",
                "the FSDP backend computes Megatron-LM's per-micro-batch aux_loss only",
                "use --moe-router-load-balancing-type aux_loss, or --train-backend megatron",
            )
        return
    tp = args.tensor_model_parallel_size
    if etp not in (None, 1, tp):
        fail(
            f"--expert-tensor-parallel-size {etp} with --tensor-model-parallel-size {tp}",
            "rl_plugin's Megatron backend loads and exports experts that are whole (1) or split like the dense layers",
            f"use --expert-tensor-parallel-size 1 or {tp}",
        )
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    pp = args.pipeline_model_parallel_size
    if ep > 1 and (world // pp) % ((etp or tp) * ep):
        fail(
            f"--expert-model-parallel-size {ep} with {world} training processes",
            f"megatron-core needs the world / PP ({world // pp}) to be a multiple of expert-TP ({etp or tp}) x EP ({ep})",
            "launch more training processes or lower --expert-model-parallel-size",
        )
