"""Packed (``thd``) RoPE without megatron-core's per-sample Python loop, at context-parallel size 1.

megatron-core 0.16.1's unfused thd RoPE (``rope_utils._apply_rotary_pos_emb_thd``, used whenever
``apply_rope_fusion`` is off, as in rl_plugin's local and CPU runs) splits the packed stream into
its samples and, in a Python loop over them, slices each one's frequency rows, concatenates the
slices and applies the bshd kernel once to the whole stream. For the embedded run (128 samples,
2 layers, q and k, two forwards per rollout) that is ~1000 loop iterations per rollout. The rows
it gathers are, for packed position ``p`` of sample ``i`` (``cu[i] <= p < cu[i+1]``):

    freqs has one row per packed position (freqs.size(0) == cu[-1]):   row p
    otherwise (rows for positions 0 .. max_s - 1):                     row p - cu[i]

``vectorized_thd_rope`` gathers the same rows with one index and evaluates the same bshd formula
(``rope_utils._apply_rotary_pos_emb_bshd``) on the same tensors, so the result is bitwise identical:

    cos_ = (cos(freqs[rows]) * mscale).to(t.dtype)      sin_ likewise
    out  = t * cos_ + rotate_half(t) * sin_              rotate_half(x1 | x2) = (-x2 | x1)

``cos_`` / ``sin_`` depend only on ``(freqs, cu_seqlens, mscale, dtype)``, which q and k of every
layer share within a forward (and the frequency table is megatron's ``lru_cache``d tensor), so
``RopeTables`` computes them once per packed layout instead of once per call (4 ``cos`` + 4 ``sin``
over ``[t, dim]`` per layer pair on the embedded run), expanded once to ``[t, 1, heads, dim]``
contiguous (same values; the two products then run on dense operands instead of broadcasting over
the heads, ~3x faster on CPU). megatron-core's trailing ``cat((t, t_pass))`` with an empty
``t_pass`` is a copy and is skipped. Interleaved, multi-latent and partial-dimension RoPE keep
megatron-core's bshd function. Context parallelism (zigzag chunks per sample) keeps
megatron-core's own loop; it needs transformer-engine, whose fused kernel is used then.
"""

from __future__ import annotations

import torch

_ORIGINAL = {}
MODULES = (
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
)


def packed_freq_rows(cu_seqlens: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The frequency row of every packed position (module docstring), ``[cu[-1]]`` long."""
    cu = cu_seqlens.long()
    total = int(cu[-1])
    pos = torch.arange(total, device=cu.device)
    if num_rows == total:
        return pos
    lengths = cu[1:] - cu[:-1]
    return pos - torch.repeat_interleave(cu[:-1], lengths, output_size=total)


# Expand the tables over the heads only while that stays small (a CPU / test path; GPU runs fuse RoPE).
EXPAND_MAX_ELEMENTS = 1 << 22


class RopeTables:
    """The last packed layout's ``(cos_, sin_)`` (module docstring), keyed on the frequency table
    (by identity), the ``cu_seqlens`` values, ``mscale`` and dtype; expanded copies per head count."""

    def __init__(self):
        self.key = None
        self.tables = {}

    def get(self, cu_seqlens: torch.Tensor, freqs: torch.Tensor, mscale: float, dtype, heads: int):
        key = self.key
        if not (
            key is not None
            and key[0] is freqs
            and key[2] == mscale
            and key[3] == dtype
            and (key[1] is cu_seqlens or (key[1].shape == cu_seqlens.shape and torch.equal(key[1], cu_seqlens)))
        ):
            rows = packed_freq_rows(cu_seqlens, freqs.size(0)).to(freqs.device)
            f = freqs[rows]
            self.key = (freqs, cu_seqlens.clone(), mscale, dtype)
            self.tables = {1: ((torch.cos(f) * mscale).to(dtype), (torch.sin(f) * mscale).to(dtype))}
        if heads not in self.tables:
            cos_, sin_ = self.tables[1]
            shape = (cos_.shape[0], 1, heads, cos_.shape[-1])
            if cos_.shape[0] * heads * cos_.shape[-1] > EXPAND_MAX_ELEMENTS:
                return cos_, sin_
            self.tables[heads] = (cos_.expand(shape).contiguous(), sin_.expand(shape).contiguous())
        return self.tables[heads]


TABLES = RopeTables()


def vectorized_thd_rope(
    t,
    cu_seqlens,
    freqs,
    rotary_interleaved=False,
    multi_latent_attention=False,
    mscale=1.0,
    cp_group=None,
    **newer,
):
    """Drop-in for megatron-core's ``_apply_rotary_pos_emb_thd`` (same signature and result).
    ``newer``: keywords of later releases, passed on as given (megatron-core 0.19 renames
    ``multi_latent_attention`` to ``mla_rotary_interleaved`` and warns on the old name)."""
    from megatron.core.models.common.embeddings import rope_utils

    if "mla_rotary_interleaved" in newer:
        mla = bool(newer["mla_rotary_interleaved"])
        spelling = {}
    else:
        mla = bool(multi_latent_attention)
        spelling = {"multi_latent_attention": multi_latent_attention}
    if cp_group is None or cp_group.size() != 1:
        return _ORIGINAL["fn"](
            t,
            cu_seqlens,
            freqs,
            rotary_interleaved=rotary_interleaved,
            mscale=mscale,
            cp_group=cp_group,
            **spelling,
            **newer,
        )
    if not rotary_interleaved and not mla and freqs.shape[-1] == t.shape[-1]:
        cos_, sin_ = TABLES.get(cu_seqlens, freqs, mscale, t.dtype, t.shape[1])
        t = t.unsqueeze(1)  # [t, 1, heads, dim], the bshd kernel's layout
        x1, x2 = torch.chunk(t, 2, dim=-1)
        return ((t * cos_) + (torch.cat((-x2, x1), dim=-1) * sin_)).squeeze(1)
    rows = packed_freq_rows(cu_seqlens, freqs.size(0))
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),
        freqs[rows.to(freqs.device)],
        rotary_interleaved=rotary_interleaved,
        mscale=mscale,
        **spelling,
        **{k: v for k, v in newer.items() if k == "mla_rotary_interleaved"},
    ).squeeze(1)


def install() -> None:
    """Route megatron-core's unfused thd RoPE through ``vectorized_thd_rope`` (idempotent)."""
    import importlib

    for name in MODULES:
        mod = importlib.import_module(name)
        current = getattr(mod, "_apply_rotary_pos_emb_thd", None)
        if current is None or current is vectorized_thd_rope:
            continue
        _ORIGINAL.setdefault("fn", current)
        mod._apply_rotary_pos_emb_thd = vectorized_thd_rope
