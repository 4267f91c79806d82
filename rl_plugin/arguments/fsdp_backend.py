"""Flags and rules of the FSDP2 backend (``--train-backend fsdp``)."""

from __future__ import annotations

from rl_plugin.arguments._util import add_flag, fail

ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")


def add_arguments(parser):
    g = parser.add_argument_group(
        "fsdp backend", "Settings read only by --train-backend fsdp (PyTorch FSDP2 on the Hugging Face model)."
    )
    add_flag(
        g,
        "--fsdp-attn-implementation",
        choices=ATTN_IMPLEMENTATIONS,
        default="sdpa",
        help="Hugging Face attention implementation of the FSDP backend. sdpa / eager isolate packed samples with a block-diagonal causal mask (T x T per micro-batch, fine on CPU and for short packs); flash_attention_2/3 (GPU, needs flash-attn) split packed samples by position-id resets with varlen kernels and no mask: use them for long packed micro-batches.",
    )
    return parser


def validate(args) -> None:
    if args.train_backend != "fsdp":
        if args.fsdp_attn_implementation != "sdpa":
            fail(
                f"--fsdp-attn-implementation {args.fsdp_attn_implementation} with --train-backend {args.train_backend}",
                "only the FSDP backend reads it (megatron-core chooses its own attention)",
                "drop the flag or use --train-backend fsdp",
            )
        return
    if args.pipeline_model_parallel_size > 1:
        fail(
            f"--train-backend fsdp with --pipeline-model-parallel-size {args.pipeline_model_parallel_size}",
            "the FSDP backend shards over data parallelism only",
            "set --pipeline-model-parallel-size 1",
        )
    if args.fp16:
        fail(
            "--train-backend fsdp with --fp16",
            "the FSDP backend has no loss scaler, so fp16 gradients can underflow silently",
            "use --bf16 (bf16 compute, fp32 master weights and gradient reduction)",
        )
