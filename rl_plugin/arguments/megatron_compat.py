"""Megatron-LM flags the plugin reads, for when Megatron-LM's own parser is not in use.

megatron-core on PyPI ships no ``megatron.training``; our parser then defines these flags itself,
spelled and defaulted as Megatron-LM spells them, so a training shell ports over unchanged. When
``add_rl_arguments`` runs as Megatron-LM's ``extra_args_provider``, this module is not used.
"""

from __future__ import annotations

import math

from rl_plugin.arguments._util import add_flag, fail


def add_arguments(parser):
    g = parser.add_argument_group(
        "megatron", "Megatron-LM flags (defined here only when Megatron-LM's parser is absent)"
    )
    add_flag(
        g,
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="Tensor (vocab/hidden) parallel size (Megatron-LM).",
    )
    add_flag(
        g,
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help=(
            "Pipeline parallel size (Megatron-LM): the layers split evenly over this many stages, trained "
            "through megatron-core's 1F1B schedule with the loss on the last stage (--train-backend megatron)."
        ),
    )
    add_flag(
        g,
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help=(
            "Interleaved (virtual) pipeline schedule (Megatron-LM): each pipeline rank holds several model chunks of "
            "this many layers (layers / (--pipeline-model-parallel-size x N) chunks per rank); needs "
            "--pipeline-model-parallel-size > 1. Mutually exclusive with --num-virtual-stages-per-pipeline-rank."
        ),
    )
    add_flag(
        g,
        "--num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        help=(
            "Interleaved (virtual) pipeline schedule (Megatron-LM): the number of model chunks each pipeline rank "
            "holds (the layers split evenly over --pipeline-model-parallel-size x this many chunks); needs "
            "--pipeline-model-parallel-size > 1."
        ),
    )
    add_flag(
        g,
        "--context-parallel-size",
        type=int,
        default=1,
        help="Context parallel size: each sequence is cut into 2*cp zigzag chunks (Megatron-LM). Needs transformer-engine attention on the Megatron backend.",
    )
    add_flag(g, "--sequence-parallel", action="store_true", help="Megatron sequence parallelism over the TP group.")
    add_flag(
        g,
        "--micro-batch-size",
        type=int,
        default=1,
        help="Samples per micro-batch per data-parallel rank (Megatron-LM).",
    )
    add_flag(
        g,
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per optimizer step over all data-parallel ranks (Megatron-LM). Mutually exclusive with --docs-per-step.",
    )
    add_flag(
        g,
        "--seq-length",
        type=int,
        default=None,
        help="Padded sequence length. With --qkv-format bshd it is the length every sample is padded to and the length CP chunks by.",
    )
    add_flag(
        g,
        "--bf16",
        action="store_true",
        help="Train in bfloat16 with fp32 main parameters and gradients (Megatron-LM).",
    )
    add_flag(g, "--fp16", action="store_true", help="Train in float16 (Megatron-LM). Not recommended for RL.")
    add_flag(
        g,
        "--calculate-per-token-loss",
        action="store_true",
        help="Megatron-LM's per-token loss normalisation. In rl_plugin the legacy spelling of --loss-aggregation token_mean.",
    )
    return parser


# (flag, attribute, lowest allowed, lowest is allowed, highest (exclusive) or None, example fix)
RANGES = (
    ("--micro-batch-size", "micro_batch_size", 1, True, None, "--micro-batch-size 1"),
    ("--seq-length", "seq_length", 1, True, None, "--seq-length 4096"),
    ("--tensor-model-parallel-size", "tensor_model_parallel_size", 1, True, None, "--tensor-model-parallel-size 1"),
    (
        "--pipeline-model-parallel-size",
        "pipeline_model_parallel_size",
        1,
        True,
        None,
        "--pipeline-model-parallel-size 1",
    ),
    ("--context-parallel-size", "context_parallel_size", 1, True, None, "--context-parallel-size 1"),
    (
        "--num-layers-per-virtual-pipeline-stage",
        "num_layers_per_virtual_pipeline_stage",
        1,
        True,
        None,
        "--num-layers-per-virtual-pipeline-stage 2",
    ),
    (
        "--num-virtual-stages-per-pipeline-rank",
        "num_virtual_stages_per_pipeline_rank",
        1,
        True,
        None,
        "--num-virtual-stages-per-pipeline-rank 2",
    ),
)


def _in_range(value, low, low_ok: bool, high) -> bool:
    if not math.isfinite(value):
        return False
    return (value >= low if low_ok else value > low) and (high is None or value < high)


def validate(args) -> None:
    """Ranges of the Megatron-LM flags the plugin reads (Megatron-LM itself does not check them:
    a negative --lr trains uphill, --adam-beta1 2 diverges). A flag Megatron-LM's parser lacks
    (when this runs as its ``extra_args_provider``) is skipped."""
    for flag, attr, low, low_ok, high, example in RANGES:
        value = getattr(args, attr, None)
        if value is None:
            continue
        if not _in_range(value, low, low_ok, high):
            interval = (
                f"{'[' if low_ok else '('}{low}, {high})"
                if high is not None
                else (f">= {low}" if low_ok else f"> {low}")
            )
            fail(flag, f"must be {'in ' if high is not None else ''}{interval} (got {value})", f"use e.g. {example}")
    _validate_virtual_pipeline(args)


def _validate_virtual_pipeline(args) -> None:
    """The interleaved schedule's flags: one of the two, and only with pipeline stages to interleave
    (the layer count is checked against the model in ``model_layout``)."""
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    per_rank = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    if per_stage is not None and per_rank is not None:
        fail(
            f"--num-layers-per-virtual-pipeline-stage {per_stage} with --num-virtual-stages-per-pipeline-rank {per_rank}",
            "both size the model chunks of the interleaved schedule",
            "pass only one of them",
        )
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    flag = (
        "--num-layers-per-virtual-pipeline-stage" if per_stage is not None else "--num-virtual-stages-per-pipeline-rank"
    )
    value = per_stage if per_stage is not None else per_rank
    if value is not None and pp < 2:
        fail(
            f"{flag} {value} with --pipeline-model-parallel-size {pp}",
            "the interleaved schedule interleaves model chunks over pipeline stages, and there is one stage",
            f"add --pipeline-model-parallel-size 2 (or more), or drop {flag}",
        )
