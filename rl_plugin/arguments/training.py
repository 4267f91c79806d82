"""Flags that choose the training backend and its model, shared by both backends."""

from __future__ import annotations

from rl_plugin.arguments._util import add_flag, fail
from rl_plugin.registries import TRAIN_BACKENDS


def add_arguments(parser):
    g = parser.add_argument_group("training backend", "Which backend trains, and from which Hugging Face checkpoint.")
    add_flag(
        g,
        "--train-backend",
        choices=TRAIN_BACKENDS.names(),
        default="megatron",
        help="megatron: megatron-core GPTModel (TP, CP with transformer-engine, distributed optimizer). fsdp: PyTorch FSDP2 on the Hugging Face model (DP only), for models without a Megatron definition.",
    )
    add_flag(
        g,
        "--hf-checkpoint",
        type=str,
        default=None,
        help="Hugging Face checkpoint directory (config.json + safetensors) to start from. Both backends load it; the Megatron backend converts it with mbridge (dense llama, mistral, qwen2, qwen3), fsdp takes any AutoModelForCausalLM; another model is refused at start-up. Default: the embedded tiny model.",
    )
    add_flag(
        g,
        "--save-hf",
        type=str,
        default=None,
        help="Write the trained weights as a Hugging Face directory (safetensors) here at every save.",
    )
    return parser


def validate(args) -> None:
    decay_style = getattr(args, "lr_decay_style", "constant")
    if decay_style != "constant" and getattr(args, "lr_decay_iters", None) is None:
        fail(
            f"--lr-decay-style {decay_style}",
            "the decay schedule needs its length, and an RL run has no --train-iters to default it to "
            "(it would otherwise silently never decay)",
            "pass --lr-decay-iters N (optimizer steps), or use --lr-decay-style constant",
        )
    if args.train_backend == "megatron":
        if getattr(args, "fp16", False):
            fail(
                "--train-backend megatron with --fp16",
                "rl_plugin's Megatron backend trains in bf16 or fp32 (no fp16 loss scaling path)",
                "use --bf16 (bf16 compute, fp32 main weights and gradients)",
            )
    if args.train_backend == "fsdp":
        for flag, value in (
            ("--tensor-model-parallel-size", args.tensor_model_parallel_size),
            ("--context-parallel-size", args.context_parallel_size),
        ):
            if value > 1:
                fail(
                    f"--train-backend fsdp with {flag} {value}",
                    "the FSDP backend shards over data parallelism only",
                    f"use --train-backend megatron for {flag} > 1, or set it to 1",
                )
