"""Packed (``thd``) RoPE without megatron-core's per-sample Python loop, at context-parallel size 1.

megatron-core 0.16.1's unfused thd RoPE (``rope_utils._apply_rotary_pos_emb_thd``, used whenever
``apply_rope_fusion`` is off, as in rl_plugin's local and CPU runs) splits the packed stream into
its samples and, in a Python loop over them, slices each one's frequency rows, concatenates the
slices and applies the bshd kernel once to the whole stream. For the embedded run (128 samples,
2 layers, q and k, two forwards per rollout) that is ~1000 loop iterations per rollout. The rows
it gathers are, for packed position ``p`` of sample ``i`` (``cu[i] <= p < cu[i+1]``):

    freqs has one row per packed position (freqs.size(0) == cu[-1]):   row p
    otherwise (rows for positions 0 .. max_s - 1):                     row p - cu[i]

``vectorized_thd_rope`` gathers the same rows with one index and calls the same bshd kernel on the
same tensors, so the result is bitwise identical. Context parallelism (zigzag chunks per sample)
keeps megatron-core's own loop; it needs transformer-engine, whose fused kernel is used then.
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


def vectorized_thd_rope(
    t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0, cp_group=None
):
    """Drop-in for megatron-core's ``_apply_rotary_pos_emb_thd`` (same signature and result)."""
    from megatron.core.models.common.embeddings import rope_utils

    if cp_group is None or cp_group.size() != 1:
        return _ORIGINAL["fn"](
            t,
            cu_seqlens,
            freqs,
            rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention,
            mscale=mscale,
            cp_group=cp_group,
        )
    rows = packed_freq_rows(cu_seqlens, freqs.size(0))
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),
        freqs[rows.to(freqs.device)],
        rotary_interleaved=rotary_interleaved,
        multi_latent_attention=multi_latent_attention,
        mscale=mscale,
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
