"""A micro-batch's routed experts in the order its model input holds the tokens.

``StepBatch.routed_experts`` is per token of the packed samples (``[sum T_i, layers, k]``);
``ResponseLayout.input_index`` maps each CP-local input position to its token (-1: padding).
``local_routed_experts`` gathers by it: ``[n_in, layers, k]`` with ``n_in`` the positions of
``MicroBatchInputs.input_ids`` flattened row-major (thd: the packed stream; bshd: ``[S, len]``
sample-major). Padding positions get ``UNROUTED`` rows (``-1``): no engine routed them (padding,
each sample's last token, another CP rank's tokens), so the replays let the trainer's own router
route them (``routing.hf.replay_routing``, ``backends.megatron.routing_replay.replaying``): they spread
over the experts as they would without replay, instead of all landing on experts ``0..k-1`` (EP
rank 0's load, the expert-bias counts). No real token attends to padding and the last token's
logits are never read, so their routing changes no log-prob.

``routed_response_mask`` marks the positions the agreement metric counts; ``AgreementCounter``
sums it over a pass.
"""

from __future__ import annotations

from typing import Optional

import torch

UNROUTED = -1  # an expert id no engine gave: the trainer's router routes the token itself


def pad_experts(n: int, layers: int, top_k: int) -> torch.Tensor:
    """``[n, layers, top_k]`` int16 ``UNROUTED`` rows (padding and unrun positions)."""
    return torch.full((n, layers, top_k), UNROUTED, dtype=torch.int16)


def own_where_unrouted(target: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """``[N, k]`` long: ``target``'s rows, the router's ``own`` top-k where ``target`` holds
    ``UNROUTED`` (one vectorised ``where``)."""
    target = target.to(device=own.device, dtype=torch.long)
    unrouted = (target < 0).any(dim=-1, keepdim=True)
    return torch.where(unrouted, own.long(), target)


def local_routed_experts(input_index: torch.Tensor, routed: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``routed[input_index]`` (``[n_in, layers, k]``), padding positions (``-1``) as
    ``pad_experts``; None when ``routed`` is None."""
    if routed is None:
        return None
    index = input_index.reshape(-1)
    valid = index >= 0
    out = pad_experts(index.numel(), routed.shape[1], routed.shape[2]).to(routed.dtype)
    out[valid] = routed[index[valid]]
    return out


def routed_response_mask(total_lengths: torch.Tensor, response_lengths: torch.Tensor, input_index: torch.Tensor):
    """``[n_in]`` bool over the local input positions: a response token the engine ran through
    the model (every response token but its sample's last), the tokens whose routing the
    agreement metric counts; False for prompt tokens, last tokens and padding."""
    tl, rl = total_lengths.long(), response_lengths.long()
    starts = torch.cumsum(tl, 0) - tl
    pos = torch.arange(int(tl.sum())) - torch.repeat_interleave(starts, tl)
    prompt = torch.repeat_interleave(tl - rl, tl)
    last = torch.repeat_interleave(tl - 1, tl)
    per_token = (pos >= prompt) & (pos < last)
    index = input_index.reshape(-1)
    out = torch.zeros(index.numel(), dtype=torch.bool)
    valid = index >= 0
    out[valid] = per_token[index[valid]]
    return out


class AgreementCounter:
    """Sums (agreeing, counted) (routed response token, MoE layer) pairs over a pass's
    micro-batches: ``agree`` ``[N]`` bool per layer, ``mask`` ``[N]`` the tokens counted."""

    def __init__(self):
        self.agree = 0
        self.total = 0

    def add(self, agree: torch.Tensor, mask: torch.Tensor) -> None:
        self.agree += int((agree & mask).sum())
        self.total += int(mask.sum())
