"""The LM head fused with log-probs and entropy: ``[T, V]`` logits never exist.

From the response rows' final hidden states ``h [T, H]`` and this TP rank's output-weight shard
``W [V_local, H]`` (vocab ids ``[vocab_start, vocab_start + V_local)``), with ``z = h W^T / tau``
(tau = ``--rollout-temperature``), every token gets

    lse     = log sum_v exp(z_v)             (max and sum-exp all-reduced over TP)
    logp    = z_target - lse                 (the target logit lives on one TP shard)
    entropy = lse - sum_v p_v z_v            (p = softmax(z))

exactly as ``log_probs_and_entropy`` computes them from materialised logits. Here the forward
computes the head ``chunk_size`` tokens at a time (one ``[chunk, V_local]`` block of logits lives
at a time) and keeps only per-token scalars (lse, entropy). The backward recomputes the logits in
blocks of the same size, ``[T, width]`` over a slice of the vocabulary (one extra matmul in all),
and turns the per-token upstream gradients ``a = dJ/dlogp``, ``b = dJ/dentropy`` into

    dJ/dz_v = a (1[v = target] - p_v) - b p_v (log p_v + entropy)
    dJ/dh  += (dJ/dz / tau) W            (fp32 [T, H] accumulator; all-reduced over TP once)
    dJ/dW   = (dJ/dz / tau)^T h          (each vocab slice complete after one matmul: written in
                                          the weight's dtype, or added to Megatron's main_grad)

Only per-token scalars cross TP in the forward (one MAX of [chunk], one SUM of [4, chunk] per
chunk: the fourth row counts the shards holding each target, so an id outside the vocabulary
fails loud, ``logprobs.check_targets_in_vocab``). Precision follows the unfused path: with
``fp32_head`` (``--fp32-lm-head``) or fp32 weights the matmul accumulates in fp32 and the logits
are fp32; otherwise the matmul runs in the weight's dtype (bf16 logits, as the model's own head
gives) and the softmax in fp32. fp64 inputs compute in fp64 (the exactness tests). The weight
gradient (one matmul per vocab slice, fp32 accumulation inside it) reaches the ORIGINAL weight:
added to ``main_grad`` under Megatron DDP (the autograd grad is then zeros, so DDP's hook still
fires), else returned in the weight's dtype.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from rl_plugin.loss.logprobs import check_targets_in_vocab, shard_targets

# A chunk's logits block holds at most this many elements: two such fp32 blocks (and one in the
# matmul dtype) are the whole workspace of the backward. CPU: 8 MiB in fp32 (cache-sized blocks).
# CUDA: 256 MiB, since each chunk costs one TP all-reduce pair and a kernel launch series: at
# V_local = 152k, 32k tokens are ~74 chunks instead of ~2.4k (a GPU setting, not measured here).
DEFAULT_CHUNK_ELEMENTS = 1 << 21
CUDA_CHUNK_ELEMENTS = 1 << 26


def default_chunk_rows(v_local: int, elements: Optional[int] = None, device=None) -> int:
    """Tokens per chunk so that a ``[chunk, V_local]`` block has at most ``elements`` entries
    (default: ``CUDA_CHUNK_ELEMENTS`` on a CUDA ``device``, else ``DEFAULT_CHUNK_ELEMENTS``)."""
    if elements is None:
        on_cuda = device is not None and torch.device(device).type == "cuda"
        elements = CUDA_CHUNK_ELEMENTS if on_cuda else DEFAULT_CHUNK_ELEMENTS
    return max(1, elements // max(1, v_local))


def add_target_term(
    g: torch.Tensor, local_t: torch.Tensor, a_target: torch.Tensor, v0: int, v1: int, sync_free: bool
) -> None:
    """``g[i, local_t[i] - v0] += a_target[i]`` for the rows whose target lies in the vocab block
    ``[v0, v1)``. ``sync_free`` (CUDA): every row adds, clamped into the block, the rows without a
    target there adding 0 (no ``nonzero``, so no host sync per block); else only the hit rows
    (``nonzero``: cheap and synchronous anyway on a CPU). The same values (up to the sign of a zero)."""
    in_block = (local_t >= v0) & (local_t < v1)
    if sync_free:
        rows = torch.arange(g.shape[0], device=g.device)
        cols = (local_t - v0).clamp(0, v1 - v0 - 1)
        g.index_put_((rows, cols), torch.where(in_block, a_target, torch.zeros_like(a_target)), accumulate=True)
        return
    hit = torch.nonzero(in_block).squeeze(1)  # targets in this block
    if hit.numel():
        g.index_put_((hit, local_t[hit] - v0), a_target[hit], accumulate=True)


def _dtypes(hidden: torch.Tensor, weight: torch.Tensor, fp32_head: bool):
    """(matmul dtype, softmax/accumulation dtype)."""
    if torch.float64 in (hidden.dtype, weight.dtype):
        return torch.float64, torch.float64
    if fp32_head or weight.dtype == torch.float32:
        return torch.float32, torch.float32
    return weight.dtype, torch.float32


class _FusedHeadLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        targets,
        vocab_start,
        tp_group,
        inv_temp,
        chunk,
        with_entropy,
        fp32_head,
        reduce_hidden_grad,
    ):
        rows, v_local = hidden.shape[0], weight.shape[0]
        mm_dtype, acc = _dtypes(hidden, weight, fp32_head)
        w_mm = weight.detach().to(mm_dtype)  # no copy unless fp32_head on a bf16 weight ([V_local, H])
        logp = torch.empty(rows, dtype=acc, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.zeros_like(logp)
        local_t, in_shard = shard_targets(targets, vocab_start, v_local)
        hits = torch.empty_like(logp)  # shards holding each row's target, summed over TP: must be 1
        for s in range(0, rows, chunk):  # token chunks: one [chunk, V_local] block at a time
            e = min(s + chunk, rows)
            z = torch.mm(hidden[s:e].detach().to(mm_dtype), w_mm.t()).to(acc)
            z.mul_(inv_temp)
            zmax = z.amax(-1)
            if tp_group is not None:
                dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=tp_group)
            z_target = z.gather(1, local_t[s:e].unsqueeze(1)).squeeze(1) - zmax
            z.sub_(zmax.unsqueeze(-1))  # z - max: <= 0
            ez = torch.exp(z)
            packed = torch.stack(
                [
                    ez.sum(-1),
                    z_target * in_shard[s:e],
                    torch.linalg.vecdot(ez, z) if with_entropy else zmax.new_zeros(e - s),
                    in_shard[s:e].to(acc),
                ]
            )
            del ez, z
            if tp_group is not None:
                dist.all_reduce(packed, group=tp_group)
            sumexp, zt, sum_ez_z, hits[s:e] = packed
            log_sum = torch.log(sumexp)
            lse[s:e] = zmax + log_sum
            logp[s:e] = zt - log_sum
            if with_entropy:
                entropy[s:e] = log_sum - sum_ez_z / sumexp
        check_targets_in_vocab(hits, targets, v_local, tp_group)  # out-of-vocab targets fail loud
        ctx.save_for_backward(hidden, weight, local_t, in_shard, lse, entropy)
        ctx.cfg = (tp_group, inv_temp, chunk, with_entropy, fp32_head, reduce_hidden_grad)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, local_t, in_shard, lse, entropy = ctx.saved_tensors
        tp_group, inv_temp, chunk, with_entropy, fp32_head, reduce_hidden_grad = ctx.cfg
        mm_dtype, acc = _dtypes(hidden, weight, fp32_head)
        rows, v_local = hidden.shape[0], weight.shape[0]
        w_mm = weight.detach().to(mm_dtype)
        h_mm = hidden.detach().to(mm_dtype)
        a = torch.zeros_like(lse) if grad_logp is None else grad_logp.to(acc)
        use_entropy = with_entropy and grad_entropy is not None
        b = grad_entropy.to(acc) if use_entropy else None
        c = (a + b * entropy) if use_entropy else None
        neg_a = a.neg()
        a_target = a * in_shard
        # Vocab blocks of the same size as the forward's token chunks: each block's dJ/dW is
        # complete after one matmul (no [V_local, H] accumulator), dJ/dh accumulates in ``acc``.
        width = max(1, (chunk * v_local) // max(rows, 1))
        main_grad = getattr(weight, "main_grad", None)
        into_main = main_grad is not None and main_grad.dtype in (torch.float32, torch.float64)
        grad_w = main_grad if into_main else torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
        for v0 in range(0, v_local, width):
            v1 = min(v0 + width, v_local)
            g = torch.mm(h_mm, w_mm[v0:v1].t()).to(acc)  # recompute the block [rows, v1 - v0]
            g.mul_(inv_temp).sub_(lse.unsqueeze(-1))  # log p
            p = torch.exp(g)
            if use_entropy:  # -p (a + b (log p + entropy)), in place on log p
                g.mul_(b.unsqueeze(-1)).add_(c.unsqueeze(-1)).mul_(p).neg_()
            else:
                torch.mul(p, neg_a.unsqueeze(-1), out=g)
            del p
            add_target_term(g, local_t, a_target, v0, v1, sync_free=g.is_cuda)
            g.mul_(inv_temp)
            g_mm = g.to(mm_dtype)
            del g
            if acc == mm_dtype:
                grad_h.addmm_(g_mm, w_mm[v0:v1])
            else:  # bf16 operands: each block's product is added in fp32
                grad_h.add_(torch.mm(g_mm, w_mm[v0:v1]))
            gw = torch.mm(g_mm.t(), h_mm)
            if into_main:
                grad_w[v0:v1].add_(gw)
            else:
                grad_w[v0:v1] = gw
        grad_hidden = grad_h.to(hidden.dtype)
        if reduce_hidden_grad and tp_group is not None:
            dist.all_reduce(grad_hidden, group=tp_group)  # every vocab shard's share of dJ/dh
        if into_main:
            weight.grad_added_to_main_grad = True
            grad_weight = torch.zeros_like(weight)
        else:
            grad_weight = grad_w
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def fused_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group=None,
    vocab_start: int = 0,
    fp32_head: bool = False,
    chunk_size: Optional[int] = None,
    with_entropy: bool = True,
    reduce_hidden_grad: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` ``[rows]`` (fp32; fp64 for fp64 inputs) of ``softmax(hidden @ weight.T / T)``.

    ``hidden`` ``[rows, H]``: the response rows only, identical on every TP rank; ``weight``
    ``[V_local, H]``: this rank's vocab shard starting at ``vocab_start`` (shards may be uneven).
    ``chunk_size``: tokens per block (default: ``default_chunk_rows(V_local)``). The gradient of
    ``hidden`` is the full one (all-reduced over ``tp_group``) unless ``reduce_hidden_grad`` is
    False: then it is this shard's share, for a caller whose next op sums it (Megatron's
    sequence-parallel gather reduce-scatters). Entropy is zeros when ``with_entropy`` is False.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [rows, H] and weight [V_local, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected targets [rows] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (--rollout-temperature), got {temperature}")
    chunk = default_chunk_rows(weight.shape[0], device=weight.device) if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _FusedHeadLogProbs.apply(
        hidden,
        weight,
        targets,
        int(vocab_start),
        tp_group,
        1.0 / float(temperature),
        chunk,
        bool(with_entropy),
        bool(fp32_head),
        bool(reduce_hidden_grad),
    )
