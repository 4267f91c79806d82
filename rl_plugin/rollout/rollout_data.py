"""One rollout as flat tensors, and the one flattener of a rollout's ``Sample``s into it.

``RolloutData``: samples ordered by prompt group (a group's ``--n-samples-per-prompt`` samples
contiguous); ``tokens`` holds prompt + response of every sample back to back (``[sum T_i]``),
``rollout_log_probs`` the sampler's log-prob of each response token and ``loss_mask`` its 0/1
trained flag (``[sum R_i]`` each; 0 for the ids a custom generate hook appended, tool output:
conditioned on, in no loss term and in no count). It travels
from the rollout manager to the driver (pickled with its tensors in one buffer), into a
checkpoint under overlapped training (``checkpoint.pending_rollout``), and becomes the step batch
(``loop.advantages.rollout_batch``). Under ``--use-rollout-routing-replay`` ``routed_experts`` holds,
per token of ``tokens``, per MoE layer, the ``top_k`` experts the engine routed it to
(``[sum T_i, num_moe_layers, top_k]`` int16; ``rl_plugin.routing``); the last token of each sample
never ran through the engine and holds ``UNROUTED`` (-1) rows: the trainer's router routes it
itself (its hidden state reaches no log-prob: causal attention, and its logits predict past the
sample).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import attrgetter, is_not
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from rl_plugin.cp import exclusive_cumsum, expand_runs, segment_ids
from rl_plugin.routing.layout import pad_experts
from rl_plugin.tensor_pickle import reduce_dataclass


@dataclass
class RolloutData:
    """One rollout, samples ordered by prompt group. ``tokens``: prompt + response of every sample
    (``[sum T_i]``); ``rollout_log_probs``: the sampler's log-prob of each response token;
    ``loss_mask``: 1 for a token the policy produced, 0 for one it only conditions on (fp32,
    ``[sum R_i]``; None at construction means every response token is trained)."""

    tokens: torch.Tensor
    total_lengths: torch.Tensor
    response_lengths: torch.Tensor
    rollout_log_probs: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    num_groups: int
    stats: Dict[str, float] = field(default_factory=dict)
    examples: List[Dict[str, object]] = field(default_factory=list)
    dataset_state: Optional[Dict[str, object]] = None  # the manager's state_dict() right after this generate
    weight_load: Optional[Dict[str, Any]] = None  # the weight sync generate loaded first (``update_weights``'s answer)
    routed_experts: Optional[torch.Tensor] = None  # [sum T_i, num_moe_layers, top_k] int16 (routing replay)
    loss_mask: Optional[torch.Tensor] = None
    teacher_log_probs: Optional[torch.Tensor] = None  # --use-opd with an engine-served teacher, [sum R_i]

    def __post_init__(self):
        if self.loss_mask is None:
            self.loss_mask = torch.ones(int(self.response_lengths.sum()), dtype=torch.float32)

    def model_token_counts(self) -> torch.Tensor:
        """Per sample, its trained (model-produced) response tokens: the loss mask's sum (``[S]``,
        int64); equal to ``response_lengths`` without a custom generate hook."""
        rl = self.response_lengths.long()
        sums = torch.zeros(rl.numel(), dtype=torch.float64).index_add_(0, segment_ids(rl), self.loss_mask.double())
        return sums.round().long()

    def __reduce_ex__(self, protocol):
        """Pickled (Ray's transport from the rollout manager to the driver) with its tensors in
        one buffer (``rl_plugin.tensor_pickle``): ~0.05 ms instead of torch's ~0.7 ms for the
        six tensors of the embedded rollout; torch's pickling when a tensor needs it."""
        return reduce_dataclass(self) or super().__reduce_ex__(protocol)

    def select_groups(self, groups: torch.Tensor, group_size: int) -> "RolloutData":
        """The rollout of the given groups (contiguous ``group_size`` samples each), renumbered
        ``0..len(groups)-1``; stats and examples are left to the caller."""
        groups = torch.as_tensor(groups, dtype=torch.long)
        idx = expand_runs(groups * group_size, torch.full_like(groups, group_size))
        tl, rl = self.total_lengths, self.response_lengths
        resp = expand_runs(exclusive_cumsum(rl)[idx], rl[idx])
        token_idx = expand_runs(exclusive_cumsum(tl)[idx], tl[idx])
        return RolloutData(
            tokens=self.tokens[token_idx],
            total_lengths=tl[idx],
            response_lengths=rl[idx],
            rollout_log_probs=self.rollout_log_probs[resp],
            rewards=self.rewards[idx],
            group_ids=torch.arange(groups.numel()).repeat_interleave(group_size),
            num_groups=int(groups.numel()),
            loss_mask=self.loss_mask[resp],
            routed_experts=None if self.routed_experts is None else self.routed_experts[token_idx],
            teacher_log_probs=None if self.teacher_log_probs is None else self.teacher_log_probs[resp],
        )


# the fields that travel in one buffer when pickled (``tensor_pickle.reduce_dataclass``)
RolloutData.TENSOR_FIELDS = (
    "tokens",
    "total_lengths",
    "response_lengths",
    "rollout_log_probs",
    "rewards",
    "group_ids",
    "loss_mask",
    "routed_experts",
    "teacher_log_probs",
)


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


_TOKENS, _RLEN = attrgetter("tokens"), attrgetter("response_length")
_MASK, _ROLLOUT_LP = attrgetter("loss_mask"), attrgetter("rollout_log_probs")
_STATUS_NAME, _ROUTED = attrgetter("status.name"), attrgetter("rollout_routed_experts")


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
    )


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
