"""The LM head and log-softmax of true on-policy mode (``--true-on-policy-mode``): the op library's bits.

From the response rows' final hidden states ``h [T, H]`` (identical on every TP rank) and this TP
rank's output-weight shard ``W [V_local, H]`` (vocab ids ``[vocab_start, vocab_start + V_local)``):

    logits = inv.linear(h, W)                       column split: each logit has its TP1 bits
    logp_v = inv.log_softmax(logits, T)             TP1
             vocab_parallel_log_softmax(...)        TP > 1: the block partials gathered over TP,
                                                    combined in vocab order (the TP1 bits)
    logp   = logp_target                            (the one shard holding the target; the others
                                                     add exact zeros over TP)
    entropy = -sum_v p_v logp_v                     (p = exp(logp_v); summed over TP)

so a token's log-prob is bitwise what the HF model patched by ``rl_plugin.invariant.make_invariant``
gives, whatever the TP size or the rows sharing the call. Unlike the default heads
(``fused_head``, ``logprobs``) nothing is chunked: the ``[T, V_local]`` log-probs live through the
backward, which is autograd's through the ops. Under TP each rank's loss share is its own
shard's targets (and entropy terms), summed over TP with an identity backward (megatron's
``reduce_from_tensor_model_parallel_region``); the gathers feeding the common log-sum-exp
therefore sum their gradients over TP (``_GatherLast``). A target outside the
vocabulary fails loud (``check_targets_in_vocab``).
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

from rl_plugin.loss.logprobs import check_targets_in_vocab, shard_targets


class _SumOverGroup(torch.autograd.Function):
    """All-reduce SUM forward; identity backward (every rank's loss is the same replica)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _sum_over(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _SumOverGroup.apply(x, group)


class _GatherLast(torch.autograd.Function):
    """All-gather along the last dim in rank order; backward: this rank's slice of the gradient
    SUMMED over the group (a reduce-scatter). Downstream of the gather each rank scores only the
    targets of its own shard (summed over TP by ``_SumOverGroup``, identity backward), so every
    rank's gradient of the gathered tensor is a share: another shard's targets also move this
    shard's logits through the common log-sum-exp."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.n = group, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        r = dist.get_rank(ctx.group)
        return grad[..., r * ctx.n : (r + 1) * ctx.n].contiguous(), None


def vocab_parallel_log_softmax(logits: torch.Tensor, temperature: float, tp_group) -> torch.Tensor:
    """This rank's ``[rows, V_local]`` slice of ``inv.log_softmax`` over the whole vocabulary (TP1's
    bits), from equal vocab shards in rank order. Shards of whole ``VOCAB_BLOCK`` blocks: only the
    block partials ``(m, s) [rows, blocks]`` cross TP (``inv.log_softmax_combine``); other shard
    sizes (a vocabulary under 128 per rank) gather the logits themselves (the blocks straddle ranks)."""
    from rl_plugin import invariant as inv

    n = logits.shape[-1]
    if n % inv.VOCAB_BLOCK == 0:
        scaled = inv.scale_logits(logits, temperature)
        m, s = inv.log_softmax_partials(scaled)
        lse = inv.log_softmax_combine(_GatherLast.apply(m, tp_group), _GatherLast.apply(s, tp_group))
        return scaled - lse[:, None]
    r = dist.get_rank(tp_group)
    return inv.log_softmax(_GatherLast.apply(logits, tp_group), temperature)[:, r * n : (r + 1) * n]


def invariant_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group=None,
    vocab_start: int = 0,
    with_entropy: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` ``[rows]`` in the library's dtype (module docstring). ``tp_group``: None
    at TP1. The gradient of ``hidden`` is this shard's share: the caller sums it over TP (megatron's
    ``copy_to_tensor_model_parallel_region`` on the rows). Entropy is zeros when ``with_entropy`` is False."""
    from rl_plugin import invariant as inv

    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [rows, H] and weight [V_local, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected targets [rows] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (--rollout-temperature), got {temperature}")
    v_local = weight.shape[0]
    logits = inv.linear(hidden, weight)
    if tp_group is None:
        logp_all = inv.log_softmax(logits, temperature)
    else:
        logp_all = vocab_parallel_log_softmax(logits, temperature, tp_group)
    local_t, in_shard = shard_targets(targets, vocab_start, v_local)
    picked = logp_all.gather(1, local_t.unsqueeze(1)).squeeze(1)
    logp = _sum_over(torch.where(in_shard, picked, torch.zeros_like(picked)), tp_group)
    hits = in_shard.to(logp.dtype)
    if tp_group is not None:
        hits = hits.clone()
        dist.all_reduce(hits, group=tp_group)
    check_targets_in_vocab(hits, targets, v_local, tp_group)
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    p = torch.exp(logp_all)
    plogp = torch.where(p > 0, p * logp_all, torch.zeros_like(p)).sum(-1)
    return logp, _sum_over(-plogp, tp_group)
