"""True on-policy on the Megatron backend: the local layer spec's modules computed by ``rl_plugin.invariant``.

With ``TrainConfig.true_on_policy`` (``--true-on-policy-mode``), ``apply(chunks)`` swaps, in place and
after the HF weights are loaded, the class of every module of the local layer spec (megatron-core
0.16.1, what ``compat.mbridge_fixes.local_spec_bridge_class`` builds on a machine without
transformer-engine) for a subclass whose ``forward`` calls the op library; parameters, names,
TP attributes and checkpoints are untouched:

    ColumnParallelLinear (linear_qkv, linear_fc1, output_layer)
        y = inv.linear(x, W_shard, b_shard)         a column split of W gives the TP1 bits per column
    RowParallelLinear (linear_proj, linear_fc2)
        TP1: y = inv.linear(x, W)
        TP>1: the K-chunk partials of this rank's shard (inv.linear_partials), all-gathered over TP
        in rank order (= K order) and combined by inv.combine_partials in the library's fixed order,
        instead of megatron's all-reduce: the same bits as TP1
    torch.nn.RMSNorm (input/pre-MLP/final norms, Qwen3's q/k norms)
        inv.rms_norm(x, w, eps)
    RotaryEmbedding                     returns None: megatron-core's own RoPE is skipped, and
    core attention (VarlenDotProductAttention / DotProductAttention)
        q, k <- inv.apply_rope(., cos, sin) with (cos, sin) = inv.rope_cos_sin(positions, inv_freq),
        positions restarting at 0 per sample (thd: from ``cu_seqlens``; bshd: one sample per row),
        inv_freq = megatron's (``1 / base ** (arange(0, d, 2) / d)``, HF's bits), then inv.attention over the packed samples.

The word embedding (a row lookup; under TP a masked lookup all-reduced with exact zeros), the
residual adds (bias-dropout-add at p = 0 is ``residual + x``) and SwiGLU (``silu(g) * u``,
elementwise) already give HF's bits. The head and log-softmax are the loss core's
``invariant_head`` (``forward.response_log_probs`` routes there when ``is_invariant(model)``).

Gradients flow through the ops by autograd; the TP collectives keep megatron's conventions
(column-parallel input: identity forward, all-reduce backward; the row-parallel gather: each rank
keeps its own chunks' gradient, as megatron's all-reduce passes the replicated gradient through).

``check_supported`` refuses what the mode does not cover (MoE, LoRA, sequence parallelism,
context parallelism, fp16). Nothing here is imported unless the mode is on.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention

from rl_plugin import invariant as inv
from rl_plugin.backends.megatron.forward import TRUE_ON_POLICY as MARK


def _tp_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _GatherChunks(torch.autograd.Function):
    """All-gather along dim 0 in rank order; backward: this rank's slice of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.n = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad):
        r = dist.get_rank(ctx.group)
        return grad[r * ctx.n : (r + 1) * ctx.n], None


def gather_chunks(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` of every rank of ``group`` concatenated along dim 0 in rank order (module docstring)."""
    return x if _tp_size(group) == 1 else _GatherChunks.apply(x, group)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, group, bias=None) -> torch.Tensor:
    """``x @ W^T (+ b)`` where this rank holds the K shard ``x [..., K/tp]``, ``W [N, K/tp]``: TP1's
    bits (``inv.linear``'s ``K_PARTS`` chunks, ``K_PARTS / tp`` of them on each rank)."""
    tp = _tp_size(group)
    if tp == 1:
        return inv.linear(x, weight, bias)
    partials = inv.linear_partials(x, weight, parts=inv.K_PARTS // tp)
    return inv.combine_partials(gather_chunks(partials, group), bias)


class InvariantColumnParallelLinear(ColumnParallelLinear):
    def forward(self, input_, weight: Optional[torch.Tensor] = None, runtime_gather_output: Optional[bool] = None):
        w = self.weight if weight is None else weight
        x = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)  # all-reduce of dx in backward
        out = inv.linear(x, w, None if self.skip_bias_add else self.bias)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)


class InvariantRowParallelLinear(RowParallelLinear):
    def forward(self, input_):
        x = input_ if self.input_is_parallel else scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        if self.skip_bias_add:  # the bias-dropout-add adds it: (y + b) + residual, HF's order
            return row_parallel_linear(x, self.weight, self.tp_group), self.bias
        return row_parallel_linear(x, self.weight, self.tp_group, self.bias), None


class InvariantRMSNorm(torch.nn.RMSNorm):
    def forward(self, x):
        return inv.rms_norm(x, self.weight, self.eps)


class NoRotaryEmbedding(RotaryEmbedding):
    """Megatron's RoPE off: the invariant core attention applies HF's (module docstring)."""

    def forward(self, *args, **kwargs):
        return None


class InvariantCoreAttention(DotProductAttention):
    """RoPE + causal attention per sample through the op library (module docstring). ``inv_freq``
    and ``scale`` are set by ``apply``."""

    inv_freq: torch.Tensor
    scale: float

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if attention_bias is not None:
            raise ValueError("true on-policy attention: megatron attention_bias is not supported")
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            q, k, v = query, key, value  # [t, heads, dim]
        else:  # bshd rows [s, b, heads, dim]: one sample per row, padding after the real tokens
            s, b = query.shape[:2]
            q, k, v = (x.transpose(0, 1).reshape(b * s, *x.shape[2:]) for x in (query, key, value))
            cu = torch.arange(0, (b + 1) * s, s, device=query.device)
        t = q.shape[0]
        key_start, q_pos = inv.packed_positions(cu.to(q.device).long(), t)
        cos, sin = rope_tables(q_pos, self.inv_freq, q.dtype)  # [t, 1, dim]
        q, k = inv.apply_rope(q, cos, sin), inv.apply_rope(k, cos, sin)
        out = inv.attention(q, k, v, key_start, q_pos, self.scale)  # [t, heads, dim]
        if thd:
            return out.reshape(t, -1)
        return out.reshape(b, s, -1).transpose(0, 1)


_ROPE: list = []  # the last layout's (key, cos, sin): every layer of a forward shares it


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype):
    """``inv.rope_cos_sin`` of the packed positions, kept while the positions repeat (one per forward)."""
    if _ROPE:
        (pos, freq, dt), cos, sin = _ROPE[0]
        if freq is inv_freq and dt == dtype and pos.shape == positions.shape and torch.equal(pos, positions):
            return cos, sin
    cos, sin = inv.rope_cos_sin(positions, inv_freq)  # attention_scaling 1 (default RoPE, checked at start-up)
    cos, sin = cos.to(dtype)[:, None], sin.to(dtype)[:, None]
    _ROPE[:] = [((positions, inv_freq, dtype), cos, sin)]
    return cos, sin


SWAPS = (
    (ColumnParallelLinear, InvariantColumnParallelLinear),
    (RowParallelLinear, InvariantRowParallelLinear),
    (torch.nn.RMSNorm, InvariantRMSNorm),
)


def apply(chunks) -> None:
    """Swap every module of each bare GPTModel chunk (module docstring), in place; idempotent."""
    for gpt in chunks:
        inv_freq = None
        for module in gpt.modules():
            for base, swapped in SWAPS:
                if isinstance(module, base) and not isinstance(module, swapped):
                    module.__class__ = swapped
            if isinstance(module, RotaryEmbedding):
                inv_freq = module.inv_freq  # HF's bits: 1 / base ** (arange(0, d, 2) / d) in fp32
                module.__class__ = NoRotaryEmbedding
        for module in gpt.modules():
            if isinstance(module, DotProductAttention):
                if inv_freq is None:
                    raise ValueError("true on-policy mode: the model has attention but no RoPE module")
                module.__class__ = InvariantCoreAttention
                module.inv_freq = inv_freq
                head = module.hidden_size_per_attention_head
                cfg_scale = module.config.softmax_scale
                module.scale = float(cfg_scale) if cfg_scale is not None else head**-0.5
        setattr(gpt, MARK, True)


def is_invariant(gpt) -> bool:
    """Whether ``apply`` swapped this bare GPTModel."""
    return bool(getattr(gpt, MARK, False))
