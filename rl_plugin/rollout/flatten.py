"""The one flattener of a rollout's ``Sample``s into ``RolloutData``'s tensors (both types in
``rollout/sample.py``), and the helpers of assembly: concatenating rollouts of whole groups and a
rollout's logged statistics."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter, is_not
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from rl_plugin.rollout.sample import RolloutData
from rl_plugin.routing.layout import pad_experts


@dataclass
class FlatSamples:
    """A rollout's samples as flat tensors (samples in order): ``tokens`` = prompt + response of
    every sample (``[sum T_i]``), ``log_probs`` and ``loss_mask`` the responses' (``[sum R_i]``,
    fp32)."""

    tokens: torch.Tensor
    total_lengths: torch.Tensor
    response_lengths: torch.Tensor
    log_probs: torch.Tensor
    loss_mask: torch.Tensor
    truncated_frac: float  # the fraction of samples that hit the length limit (status TRUNCATED)
    routed_experts: Optional[torch.Tensor] = None  # [sum T_i, layers, top_k] when the engine recorded them
    # images (``Sample.multimodal_train_inputs``; ``StepBatch``'s layout): None for text samples
    pixel_values: Optional[torch.Tensor] = None
    image_grid_thw: Optional[torch.Tensor] = None
    image_counts: Optional[torch.Tensor] = None


_TOKENS, _RLEN = attrgetter("tokens"), attrgetter("response_length")
_MASK, _ROLLOUT_LP = attrgetter("loss_mask"), attrgetter("rollout_log_probs")
_STATUS_NAME, _ROUTED = attrgetter("status.name"), attrgetter("rollout_routed_experts")
_IMAGES = attrgetter("multimodal_train_inputs")


def flatten_samples(samples: Sequence[Any]) -> FlatSamples:
    """A rollout's ``Sample``s (the default generate function's, or a hook's after
    ``sample_check``) as flat tensors, in C-level passes (``map``, ``chain``, ``numpy.fromiter``)
    instead of a Python loop over samples and tokens: ``tokens`` exactly as the samples hold them
    (token in, token out), the response lengths, the rollout log-probs (fp32, each double rounded
    to nearest, as ``torch.tensor`` of the lists), the loss mask (a None mask: all ones) and the
    routed experts (``flat_routed_experts``)."""
    n = len(samples)
    tl = np.fromiter(map(len, map(_TOKENS, samples)), np.int64, n)
    rl = np.fromiter(map(_RLEN, samples), np.int64, n)
    num_resp = int(rl.sum())
    tokens = np.fromiter(chain.from_iterable(map(_TOKENS, samples)), np.int64, int(tl.sum()))
    log_probs = np.fromiter(chain.from_iterable(map(_ROLLOUT_LP, samples)), np.float32, num_resp)
    masks = list(map(_MASK, samples))
    # no mask at all (the default generate function's samples): every response token trained
    if not any(map(is_not, masks, repeat(None))):
        mask = np.ones(num_resp, np.float32)
    else:
        masks = [m if m is not None else repeat(1, r) for m, r in zip(masks, rl.tolist())]
        mask = np.fromiter(chain.from_iterable(masks), np.float32, num_resp)
    truncated = list(map(_STATUS_NAME, samples)).count("TRUNCATED")
    return FlatSamples(
        tokens=torch.from_numpy(tokens),
        total_lengths=torch.from_numpy(tl),
        response_lengths=torch.from_numpy(rl),
        log_probs=torch.from_numpy(log_probs),
        loss_mask=torch.from_numpy(mask),
        truncated_frac=float(truncated / max(n, 1)),
        routed_experts=flat_routed_experts(list(map(_ROUTED, samples))),
        **flat_images(list(map(_IMAGES, samples))),
    )


def flat_images(inputs: Sequence[Optional[Dict[str, torch.Tensor]]]) -> Dict[str, Optional[torch.Tensor]]:
    """The samples' images in ``StepBatch``'s layout: ``pixel_values`` / ``image_grid_thw`` of
    every sample's images back to back (one ``torch.cat`` each), ``image_counts`` per sample (0 for
    a sample without images); all None when no sample has any."""
    if all(i is None for i in inputs):
        return {}
    grids = [i["image_grid_thw"] if i is not None else torch.zeros(0, 3, dtype=torch.long) for i in inputs]
    pixels = [i["pixel_values"] for i in inputs if i is not None]
    return {
        "pixel_values": torch.cat(pixels),
        "image_grid_thw": torch.cat(grids),
        "image_counts": torch.tensor([g.shape[0] for g in grids], dtype=torch.long),
    }


def flat_routed_experts(routed: Sequence[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """``[sum T_i, layers, top_k]`` int16: each sample's routed experts (``[T_i - 1, ...]``)
    followed by one ``UNROUTED`` row for its last token, which no engine ran (the trainer's router
    routes it itself, ``rl_plugin.routing.layout``); one ``torch.cat``.
    None when no sample carries them; all or none must."""
    missing = sum(r is None for r in routed)
    if missing == len(routed):
        return None
    if missing:
        i = next(i for i, r in enumerate(routed) if r is None)
        raise ValueError(f"rollout sample {i} carries no routed experts while others do (--use-rollout-routing-replay)")
    layers, top_k = routed[0].shape[1:]
    last = pad_experts(1, layers, top_k)
    return torch.cat([t for r in routed for t in (r.to(torch.int16), last)])


def concat_rollouts(parts: List[RolloutData], group_size: int) -> RolloutData:
    """Rollouts of whole groups back to back, group ids renumbered."""
    num_groups = sum(p.num_groups for p in parts)
    return RolloutData(
        tokens=torch.cat([p.tokens for p in parts]),
        total_lengths=torch.cat([p.total_lengths for p in parts]),
        response_lengths=torch.cat([p.response_lengths for p in parts]),
        rollout_log_probs=torch.cat([p.rollout_log_probs for p in parts]),
        rewards=torch.cat([p.rewards for p in parts]),
        group_ids=torch.arange(num_groups).repeat_interleave(group_size),
        num_groups=num_groups,
        loss_mask=torch.cat([p.loss_mask for p in parts]),
        routed_experts=None if parts[0].routed_experts is None else torch.cat([p.routed_experts for p in parts]),
        teacher_log_probs=None
        if parts[0].teacher_log_probs is None
        else torch.cat([p.teacher_log_probs for p in parts]),
        **{
            name: torch.cat([getattr(p, name) for p in parts])
            for name in ("pixel_values", "image_grid_thw", "image_counts")
            if parts[0].image_counts is not None
        },
    )


def rollout_stats(
    rewards: torch.Tensor, rl: torch.Tensor, truncated_frac: float, gen_time: float, reward_time: float
) -> Dict[str, float]:
    """A rollout's logged statistics: reward mean / max over samples, mean response length, the
    fraction of truncated samples, and the generation and scoring seconds."""
    return {
        "reward_mean": float(rewards.mean()),
        "reward_max": float(rewards.max()),
        "response_len_mean": float(rl.float().mean()),
        "truncated_frac": truncated_frac,
        "rollout_gen_time": gen_time,
        "rollout_reward_time": reward_time,
    }
