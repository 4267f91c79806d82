"""Log-probs and entropy from (vocab-parallel) logits, at the sampler's temperature.

With z = logits / T (T = ``--rollout-temperature``, so the ratio is 1 at step 0 on the weights
that sampled), for each token row:

    lse     = log sum_v exp(z_v)                 (max and sum-exp all-reduced over TP)
    logp    = z_target - lse                     (the target logit lives on one TP shard)
    entropy = lse - sum_v p_v z_v                (p = softmax(z))

Only per-token scalars cross the TP group (one MAX, one SUM of a packed [4, rows] tensor per
chunk); the [T, V] logits are never gathered. Rows are processed ``chunk_size`` at a time and the
backward recomputes softmax per chunk from the saved logits, so no fp32 [T, V] copy is held:

    d logp / d z_v    = 1[v = target] - p_v
    d entropy / d z_v = -p_v (log p_v + entropy)

A target id outside the (full, all TP shards) vocabulary fails loud (``TargetOutOfVocabError``,
naming the row, the id and the vocabulary size) instead of returning ``-lse``: each rank counts
the targets its shard holds in an extra row of the per-chunk SUM that crosses TP anyway, so the
check is global, needs no extra collective, and syncs the host once per call.

``fp32_output_projection`` is the ``--fp32-lm-head`` projection: fp32 accumulation and fp32
logits from bf16 hidden states and weight; the weight gradient is computed in fp32 and reaches
the ORIGINAL weight (added straight into ``main_grad`` under Megatron DDP, else returned as the
weight's grad), never a detached copy.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from rl_plugin.loss.errors import BadBatchError


class TargetOutOfVocabError(BadBatchError):
    """A target token id that no vocab shard holds; ``row`` is its row in the call's targets."""

    def __init__(self, message: str, row: int):
        super().__init__(message)
        self.row = row


def check_targets_in_vocab(hits: torch.Tensor, targets: torch.Tensor, v_local: int, tp_group) -> None:
    """Raise ``TargetOutOfVocabError`` unless every row's target is held by exactly one vocab shard.

    ``hits[r]``: how many shards hold row r's target, already summed over ``tp_group`` (identical
    on every TP rank, so all ranks raise together; the vocabulary size costs one more all-reduce
    on that path only)."""
    if hits.numel() == 0 or bool((hits == 1).all()):
        return
    row = int(torch.nonzero(hits != 1).flatten()[0])
    vocab = torch.tensor([v_local], dtype=torch.long, device=hits.device)
    if tp_group is not None:
        dist.all_reduce(vocab, group=tp_group)
    raise TargetOutOfVocabError(
        f"target token id {int(targets[row])} (response row {row} of this micro-batch) is outside the "
        f"vocabulary [0, {int(vocab.item())}): the rollout produced a token the trained model cannot "
        "score; check that the tokenizer and --hf-checkpoint / the model's vocab size match",
        row,
    )


def shard_targets(targets: torch.Tensor, vocab_start: int, v_local: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(local_t, in_shard)``: each target's column in this rank's vocab shard
    ``[vocab_start, vocab_start + v_local)``, clamped into it so gathers stay in bounds, and
    whether the target is in the shard at all (only that rank contributes its logit)."""
    local_t = targets.long() - vocab_start
    in_shard = (local_t >= 0) & (local_t < v_local)
    return local_t.clamp(0, max(v_local - 1, 0)), in_shard


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, tp_group, inv_temp, chunk_size, with_entropy):
        rows, v_local = logits.shape
        compute = torch.promote_types(logits.dtype, torch.float32)  # fp32, or fp64 for fp64 logits
        logp = torch.empty(rows, dtype=compute, device=logits.device)
        lse = torch.empty_like(logp)
        entropy = torch.zeros_like(logp)
        local_t, in_shard = shard_targets(targets, vocab_start, v_local)
        hits = torch.empty_like(logp)  # shards holding each row's target, summed over TP: must be 1
        for s in range(0, rows, chunk_size):  # loop over token chunks, bounded memory
            e = min(s + chunk_size, rows)
            z = logits[s:e].to(compute) * inv_temp  # the only fp32 [chunk, V/tp] buffer
            zmax = z.max(-1).values
            if tp_group is not None:
                dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=tp_group)
            ez = torch.exp(z - zmax.unsqueeze(-1))
            packed = torch.stack(
                [
                    ez.sum(-1),
                    z.gather(1, local_t[s:e].unsqueeze(1)).squeeze(1) * in_shard[s:e],
                    torch.where(ez > 0, ez * z, torch.zeros_like(z)).sum(-1) if with_entropy else zmax.new_zeros(e - s),
                    in_shard[s:e].to(compute),
                ]
            )
            if tp_group is not None:
                dist.all_reduce(packed, group=tp_group)
            sumexp, z_target, sum_ez_z, hits[s:e] = packed
            lse[s:e] = zmax + torch.log(sumexp)
            logp[s:e] = z_target - lse[s:e]
            if with_entropy:
                entropy[s:e] = lse[s:e] - sum_ez_z / sumexp
        check_targets_in_vocab(hits, targets, v_local, tp_group)
        ctx.save_for_backward(logits, local_t, in_shard, lse, entropy)
        ctx.inv_temp, ctx.chunk_size, ctx.with_entropy = inv_temp, chunk_size, with_entropy
        ctx.mark_non_differentiable(lse)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, local_t, in_shard, lse, entropy = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        rows = logits.shape[0]
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        use_entropy = ctx.with_entropy and grad_entropy is not None
        for s in range(0, rows, ctx.chunk_size):
            e = min(s + ctx.chunk_size, rows)
            z = logits[s:e].to(lse.dtype) * ctx.inv_temp
            log_p = z - lse[s:e].unsqueeze(-1)
            p = torch.exp(log_p)
            g = -p * grad_logp[s:e].unsqueeze(-1)
            g.scatter_add_(1, local_t[s:e].unsqueeze(1), (grad_logp[s:e] * in_shard[s:e]).unsqueeze(1))
            if use_entropy:
                g -= grad_entropy[s:e].unsqueeze(-1) * torch.where(
                    p > 0, p * (log_p + entropy[s:e].unsqueeze(-1)), torch.zeros_like(p)
                )
            grad_logits[s:e] = (g * ctx.inv_temp).to(logits.dtype)
        return grad_logits, None, None, None, None, None, None


def log_probs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group=None,
    vocab_start: int = 0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)``, both ``[rows]`` fp32 (fp64 for fp64 logits), from ``logits [rows, V_local]``.

    ``logits`` may be this TP rank's vocab shard ``[vocab_start, vocab_start + V_local)``; shards
    may be uneven. Entropy is zeros when ``with_entropy`` is False.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [rows, V] and targets [rows], got {tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (--rollout-temperature), got {temperature}")
    return _VocabParallelLogProbEntropy.apply(
        logits, targets, int(vocab_start), tp_group, 1.0 / float(temperature), int(chunk_size), bool(with_entropy)
    )


class _FP32OutputProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias):
        ctx.save_for_backward(hidden, weight)
        ctx.has_bias = bias is not None
        out = torch.matmul(hidden.float(), weight.float().t())
        if bias is not None:
            out = out + bias.float()
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight = ctx.saved_tensors
        grad_out = grad_out.float()
        grad_hidden = torch.matmul(grad_out, weight.float()).to(hidden.dtype)
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_w32 = flat_grad.t().matmul(hidden.reshape(-1, hidden.shape[-1]).float())
        grad_bias = flat_grad.sum(0) if ctx.has_bias else None
        main_grad = getattr(weight, "main_grad", None)
        if main_grad is not None:
            # Megatron DDP: accumulate the fp32 gradient straight into the fp32 main_grad (no bf16
            # rounding), flag it, and hand autograd a zero grad so the DDP hook still fires.
            main_grad.add_(grad_w32.to(main_grad.dtype))
            weight.grad_added_to_main_grad = True
            grad_weight = torch.zeros_like(weight)
        else:
            grad_weight = grad_w32.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(ctx.saved_tensors[1].dtype)
        return grad_hidden, grad_weight, grad_bias


def fp32_output_projection(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``hidden @ weight.T (+ bias)`` with fp32 accumulation and fp32 output (``--fp32-lm-head``)."""
    return _FP32OutputProjection.apply(hidden, weight, bias)
