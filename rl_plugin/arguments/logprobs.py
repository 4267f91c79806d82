"""Flags of how log-probs are computed from the model's logits."""

from __future__ import annotations

import math

from rl_plugin.arguments._util import add_flag, fail


def add_arguments(parser):
    g = parser.add_argument_group("log-probs", "How training log-probs are computed from logits.")
    add_flag(
        g,
        "--rollout-temperature",
        type=float,
        default=1.0,
        help="Sampling temperature of the rollout. Training log-probs are computed at the same temperature, so the importance ratio is exactly 1 at step 0 on the sampling weights.",
    )
    add_flag(
        g,
        "--fp32-lm-head",
        action="store_true",
        help="Compute the output projection with fp32 accumulation and fp32 logits (gradient into the bf16 weight). Use with --bf16: bf16 logits lose ~3 digits of log-prob precision and bias the importance ratio.",
    )
    add_flag(
        g,
        "--log-probs-chunk-size",
        type=int,
        default=1024,
        help="Tokens per chunk when computing log-probs and entropy; bounds the fp32 [chunk, vocab/tp] buffer. The fused head uses at most this many tokens and at most 2M logits (8 MiB fp32) per chunk.",
    )
    add_flag(
        g,
        "--disable-fused-lm-head",
        action="store_true",
        help="Build the [tokens, vocab/tp] logits and take log-probs from them, instead of the default fused output projection + log-softmax that never holds them (the head is recomputed chunk by chunk in the backward; cf. Liger's fused linear cross-entropy and Wijmans et al. 2024, Cut Your Losses in Large-Vocabulary Language Models, arXiv:2411.09009). Use to compare against the unfused path; models the fused head cannot stand in for (an output bias, logit soft-capping or scaling, multi-token prediction) use the unfused path anyway.",
    )
    return parser


def validate(args) -> None:
    t = args.rollout_temperature
    if not (t is not None and math.isfinite(t) and t > 0):
        fail(
            "--rollout-temperature", f"must be a finite number > 0 (got {t})", "use the sampler's temperature, e.g. 1.0"
        )
    if args.log_probs_chunk_size < 1:
        fail("--log-probs-chunk-size", f"must be >= 1 (got {args.log_probs_chunk_size})", "use e.g. 1024")
