"""How training log-probs are computed from the logits: temperature, sequence layout, chunking."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from rl_plugin.errors import fail
from rl_plugin.flags import MEGATRON, Bounds, derived, flag


@dataclass(frozen=True)
class LogProbSettings:
    temperature: float = flag(  # the engine samples at it too (EngineConfig reads it)
        "--rollout-temperature",
        type=float,
        default=1.0,
        help="Sampling temperature of the rollout. Training log-probs are computed at the same temperature, so the importance ratio is exactly 1 at step 0 on the sampling weights.",
        group="log-probs",
    )
    qkv_format: str = flag(
        "--qkv-format",
        choices=["thd", "bshd"],
        default="thd",
        help="Sequence layout: thd packs samples back to back (no padding waste; needs varlen attention), bshd pads every sample to --seq-length.",
        group="batching",
    )
    seq_length: Optional[int] = flag(
        "--seq-length",
        type=int,
        default=None,
        help="Padded sequence length. With --qkv-format bshd it is the length every sample is padded to and the length CP chunks by.",
        bounds=Bounds(1, "--seq-length 4096"),
        **MEGATRON,
    )
    max_seq_len: Optional[int] = derived(  # the padded length of bshd; None under thd
        lambda args: args.seq_length if args.qkv_format == "bshd" else None, None
    )
    logprob_chunk_size: int = flag(
        "--log-probs-chunk-size",
        type=int,
        default=1024,
        help="Tokens per chunk when computing log-probs and entropy; bounds the fp32 [chunk, vocab/tp] buffer. The fused head uses at most this many tokens and at most 2M logits (8 MiB fp32) per chunk.",
        group="log-probs",
        bounds=Bounds(1, "1024"),
    )

    def check(self, run) -> None:
        t = self.temperature
        if not (t is not None and math.isfinite(t) and t > 0):
            fail(
                "--rollout-temperature",
                f"must be a finite number > 0 (got {t})",
                "use the sampler's temperature, e.g. 1.0",
            )
