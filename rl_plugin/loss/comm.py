"""Autograd-aware collectives for the loss core (work on gloo; ``None`` group = no-op).

The step objective is J = sum over ranks of each rank's contribution. A collective whose output
feeds every rank's contribution therefore has, as its backward, the SUM of the upstream gradients
of all ranks: all-reduce's backward is an all-reduce, and the CP gather's backward is an
all-reduce of the full-size gradient followed by taking this rank's slice.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from rl_plugin.cp import ResponseLayout, all_rank_layouts


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.clone()  # never reduce into the caller's tensor: it may be saved for backward
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()  # autograd may hand us a buffer it reuses
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable SUM all-reduce: every rank gets sum_r x_r; grad_r = sum_r' grad_r'."""
    if group is None:
        return x
    return _AllReduceSum.apply(x, group)


class _GatherResponses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local: torch.Tensor, layouts: Sequence[ResponseLayout], cp_rank: int, group) -> torch.Tensor:
        ctx.group, ctx.index = group, layouts[cp_rank].resp_index
        sizes = [lay.num_local_tokens for lay in layouts]
        width = max(sizes) if sizes else 0
        padded = x_local.new_zeros((width,) + tuple(x_local.shape[1:]))
        padded[: x_local.shape[0]] = x_local
        parts = [torch.empty_like(padded) for _ in layouts]
        dist.all_gather(parts, padded.contiguous(), group=group)
        full = x_local.new_zeros((layouts[0].num_response_tokens,) + tuple(x_local.shape[1:]))
        for lay, part, n in zip(layouts, parts, sizes):  # loop over CP ranks, not samples
            full[lay.resp_index] = part[:n]
        return full

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        grad_full = grad_full.contiguous().clone()
        dist.all_reduce(grad_full, group=ctx.group)
        return grad_full[ctx.index], None, None, None


def gather_responses(x_local: torch.Tensor, layouts: Sequence[ResponseLayout], cp_rank: int, group) -> torch.Tensor:
    """Differentiable gather of CP-local response values back to full-response order.

    ``layouts`` are all CP ranks' layouts of the micro-batch (``cp.all_rank_layouts``). Every
    response position is owned by exactly one rank, so the result is the unsliced tensor.
    """
    if group is None or len(layouts) == 1:
        full = x_local.new_zeros((layouts[0].num_response_tokens,) + tuple(x_local.shape[1:]))
        return full.index_put((layouts[0].resp_index,), x_local)
    return _GatherResponses.apply(x_local, layouts, cp_rank, group)


def gather_micro_batch_responses(
    x_local: torch.Tensor, batch, layout: ResponseLayout, ps, *, qkv_format: str, max_seq_len
) -> torch.Tensor:
    """``gather_responses`` of one micro-batch (``batch``: its samples, ``layout``: this rank's),
    with every CP rank's layout rebuilt from the sample lengths (only when CP > 1)."""
    layouts = (
        [layout]
        if ps.cp_size == 1
        else all_rank_layouts(
            batch.total_lengths,
            batch.response_lengths,
            cp_size=ps.cp_size,
            qkv_format=qkv_format,
            max_seq_len=max_seq_len,
        )
    )
    return gather_responses(x_local, layouts, ps.cp_rank, ps.cp_group)
