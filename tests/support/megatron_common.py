"""Helpers for tests and benchmarks of the Megatron backend (no test logic here; the benchmarks
import it as ``tests.support.megatron_common``).

- ``make_args(*flags)``: a parsed, validated namespace from real command-line flags.
- ``synthetic_batch(...)``: a seeded global step batch with uneven lengths, one-token and empty
  (fully masked) responses, and prompt groups that straddle DP ranks once split.
- ``dp_shard(batch, dp_size, dp_rank)``: this DP rank's samples (``loss.micro_batch_plan.split_samples_for_dp``).
"""

from __future__ import annotations

from typing import Tuple

import torch

from rl_plugin.loss import StepBatch
from rl_plugin.loss.micro_batch_plan import split_samples_for_dp


def make_args(*flags: str, world_size: int = 1):
    """Validated flags; ``world_size`` training processes on one node (``--actor-num-gpus-per-node``)."""
    from rl_plugin.arguments import parse_args

    return parse_args(["--actor-num-gpus-per-node", str(world_size), *flags])


def synthetic_batch(
    *,
    seed: int = 0,
    num_prompts: int = 3,
    n_per_prompt: int = 2,
    vocab: int = 128,
    max_prompt: int = 6,
    max_response: int = 7,
    old_noise: float = 0.0,
) -> Tuple[StepBatch, int]:
    """``(batch, num_groups)``: ``num_prompts * n_per_prompt`` samples, group-major.
    ``old_noise > 0``: ``old_log_probs`` holds seeded noise of that scale (see ``with_old_log_probs``)."""
    g = torch.Generator().manual_seed(seed)
    n = num_prompts * n_per_prompt
    prompt = torch.randint(1, max_prompt + 1, (n,), generator=g)
    resp = torch.randint(1, max_response + 1, (n,), generator=g)
    resp[min(1, n - 1)] = 1  # a one-token response
    total = prompt + resp
    # ids from 1: HF embeddings give the pad row (id 0 in the tiny models) no gradient, megatron does
    tokens = torch.randint(1, vocab, (int(total.sum()),), generator=g)
    r = int(resp.sum())
    mask = (torch.rand(r, generator=g) > 0.15).float()
    ends = torch.cumsum(resp, 0)
    if n > 2:  # sample 2 is fully masked (empty): counts in N, contributes 0
        mask[int(ends[2] - resp[2]) : int(ends[2])] = 0.0
    adv = torch.repeat_interleave(torch.randn(n, generator=g), resp)
    batch = StepBatch(
        tokens=tokens,
        total_lengths=total,
        response_lengths=resp,
        loss_mask=mask,
        advantages=adv,
        group_ids=torch.arange(num_prompts).repeat_interleave(n_per_prompt),
        old_log_probs=old_noise * torch.randn(r, generator=g) if old_noise > 0 else None,
    )
    return batch.validate(), num_prompts


def dp_shard(batch: StepBatch, dp_size: int, dp_rank: int) -> StepBatch:
    return batch.select(split_samples_for_dp(batch.num_samples, dp_size)[dp_rank])


def with_old_log_probs(batch: StepBatch, old: torch.Tensor) -> StepBatch:
    """The batch with ``old_log_probs = old + batch.old_log_probs``: ``synthetic_batch(old_noise=s)``
    stores seeded per-token noise there (drawn for the GLOBAL batch, so every layout sees the same
    noise after ``dp_shard``), making some ratios leave the clip range."""
    from dataclasses import replace

    offset = batch.old_log_probs if batch.old_log_probs is not None else torch.zeros_like(old)
    return replace(batch, old_log_probs=old + offset)
