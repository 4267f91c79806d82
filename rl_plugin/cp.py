"""Zigzag context-parallel layout, as pure functions of (cp_rank, cp_size, qkv_format, lengths).

Megatron's context parallelism cuts every sequence into ``2 * cp`` equal chunks; rank ``r`` holds
chunk ``r`` and chunk ``2 * cp - 1 - r`` (the zigzag balances causal-attention work). The length
that is cut is

- ``thd`` (packed): each sample's own length T_i, padded up to a multiple of ``2 * cp``;
- ``bshd`` (padded batch): the micro-batch's padded length (``--seq-length``), the same for
  every sample. bshd needs it: there is no fallback to thd, the chunk boundaries differ.

Position ``p`` of a sequence holds the logits that predict token ``p + 1``. A sample with prompt
length P_i and response length R_i (T_i = P_i + R_i) therefore has its response log-probs at
positions ``p in [P_i - 1, T_i - 1)``; response index ``j = p - (P_i - 1)``.

``ResponseLayout`` holds, for one micro-batch on one CP rank, the flat index maps every other
module uses to slice masks, weights, advantages, old log-probs and target tokens into the rank's
local order (sample-major; within a sample chunk ``r`` then chunk ``2cp-1-r``), plus the model's
local input tokens. They are built with vectorised run expansion, no Python loop over samples.

With ``cp_size == 1`` the same code yields the trivial layout: one chunk per sample, no padding
in thd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

QKV_FORMATS = ("thd", "bshd")


def expand_runs(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenate ``arange(start, start + length)`` for every run, vectorised.

    ``expand_runs([5, 0], [2, 3]) == [5, 6, 0, 1, 2]``.
    """
    starts = starts.long()
    lengths = lengths.long()
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long)
    run_offsets = torch.cumsum(lengths, 0) - lengths
    base = torch.repeat_interleave(starts - run_offsets, lengths)
    return base + torch.arange(total, dtype=torch.long)


def exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def segment_ids(lengths: torch.Tensor) -> torch.Tensor:
    """The segment (sample) of every element of consecutive runs: ``i`` repeated ``lengths[i]``
    times, ``[sum lengths]`` int64 on ``lengths``' device. ``segment_ids([2, 0, 3]) == [0, 0, 2, 2, 2]``."""
    lengths = torch.as_tensor(lengths).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)


def _as_long(x: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.long).reshape(-1)


def padded_lengths(
    total_lengths: torch.Tensor,
    cp_size: int,
    qkv_format: str,
    max_seq_len: Optional[int] = None,
) -> torch.Tensor:
    """The per-sample length that CP cuts: thd pads T_i to a multiple of 2*cp (none at cp=1);
    bshd uses the padded batch length (``max_seq_len``, rounded up to a multiple of 2*cp)."""
    total_lengths = _as_long(total_lengths)
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"qkv_format must be one of {QKV_FORMATS}, got {qkv_format!r}")
    mult = 2 * cp_size if cp_size > 1 else 1
    if qkv_format == "thd":
        return (total_lengths + mult - 1) // mult * mult
    if max_seq_len is None:
        if cp_size > 1:
            raise ValueError(
                "bshd context parallelism needs max_seq_len (the padded length bshd chunks by; "
                "--seq-length): it never falls back to thd chunking"
            )
        max_seq_len = int(total_lengths.max()) if total_lengths.numel() else 0
    longest = int(total_lengths.max()) if total_lengths.numel() else 0
    if longest > max_seq_len:
        raise ValueError(f"bshd: a sample of length {longest} exceeds max_seq_len={max_seq_len} (--seq-length)")
    padded = (max_seq_len + mult - 1) // mult * mult
    return torch.full_like(total_lengths, padded)


def sequence_parallel_padding(packed_length: int, tp_size: int, cp_size: int) -> int:
    """Padding tokens to append, as one extra segment, to a packed ``thd`` micro-batch under
    sequence parallelism. megatron-core's SP scatter splits each CP rank's local stream
    (``packed_length / cp``) over the TP ranks, so it must divide by TP; the extra segment is cut
    into ``2 * cp`` zigzag chunks like every sample, so it is a multiple of ``2 * cp`` (cp > 1).
    ``packed_length``: the global packed length, ``sum(padded_lengths)`` (a multiple of 2*cp).
    Returns the smallest ``e >= 0`` with ``(packed_length + e) % lcm(tp * cp, 2 * cp) == 0``
    (``lcm(tp, 1) = tp`` at cp = 1); 0 at tp = 1."""
    import math

    if tp_size < 1 or cp_size < 1:
        raise ValueError(f"tp_size={tp_size} and cp_size={cp_size} must be >= 1")
    per_sample = 2 * cp_size if cp_size > 1 else 1
    if packed_length % per_sample:
        raise ValueError(f"packed_length={packed_length} is not a multiple of 2*cp={per_sample} (cp.padded_lengths)")
    mult = math.lcm(tp_size * cp_size, per_sample)
    return -packed_length % mult


def zigzag_chunks(padded: torch.Tensor, cp_rank: int, cp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Start and length of the rank's two chunks, each ``[S, 2]`` (chunk r, chunk 2cp-1-r).

    At cp=1 the first chunk is the whole sequence and the second is empty.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} outside [0, cp_size={cp_size})")
    if cp_size == 1:
        starts = torch.stack([torch.zeros_like(padded), padded], 1)
        lengths = torch.stack([padded, torch.zeros_like(padded)], 1)
        return starts, lengths
    chunk = padded // (2 * cp_size)
    starts = torch.stack([cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk], 1)
    return starts, torch.stack([chunk, chunk], 1)


@dataclass(frozen=True)
class ResponseLayout:
    """One micro-batch's response tokens in one CP rank's local order.

    Every ``*_index`` tensor has one entry per local response token (``n_local``):

    - ``resp_index``: into the micro-batch's flat full responses (``[sum R_i]``); slices masks,
      weights, advantages, old/ref/rollout log-probs (``layout.slice(x)``).
    - ``logit_index``: into the rank's flattened local model output (thd: ``[sum local_len]``,
      bshd: ``[S * local_seq_len]``); the row whose logits predict that response token.
    - ``target_index``: into the micro-batch's flat full tokens (``[sum T_i]``); the token id
      predicted, which may live on another CP rank's chunk, so targets come from full tokens.
    - ``sample_ids``: the sample (0..S-1) each local token belongs to.

    The model input: ``input_index`` (``[sum local_len]``, -1 marks padding) into flat full
    tokens and ``position_ids`` (global positions within each sample).
    """

    cp_rank: int
    cp_size: int
    qkv_format: str
    total_lengths: torch.Tensor
    response_lengths: torch.Tensor
    padded_lengths: torch.Tensor
    local_lengths: torch.Tensor
    resp_index: torch.Tensor
    logit_index: torch.Tensor
    target_index: torch.Tensor
    sample_ids: torch.Tensor
    input_index: torch.Tensor
    position_ids: torch.Tensor

    @property
    def num_samples(self) -> int:
        return int(self.total_lengths.numel())

    @property
    def num_local_tokens(self) -> int:
        return int(self.resp_index.numel())

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_lengths.sum())

    @property
    def cu_seqlens_padded(self) -> torch.Tensor:
        """Global cumulative padded lengths ``[S + 1]`` (int32), what TE's thd CP attention takes."""
        return torch.nn.functional.pad(torch.cumsum(self.padded_lengths, 0), (1, 0)).int()

    @property
    def local_cu_seqlens(self) -> torch.Tensor:
        """Cumulative local lengths ``[S + 1]`` (int32): segment boundaries in the local stream."""
        return torch.nn.functional.pad(torch.cumsum(self.local_lengths, 0), (1, 0)).int()

    def slice(self, x_full: torch.Tensor) -> torch.Tensor:
        """Full-response tensor ``[sum R_i, ...]`` -> this rank's local order (differentiable)."""
        if x_full.shape[0] != self.num_response_tokens:
            raise ValueError(
                f"expected {self.num_response_tokens} response tokens (sum of response_lengths), got {x_full.shape[0]}"
            )
        return x_full[self.resp_index]

    def local_inputs(self, tokens_flat: torch.Tensor, pad_id: int = 0) -> torch.Tensor:
        """Local model input ids. thd: ``[sum local_len]``; bshd: ``[S, local_seq_len]``."""
        if tokens_flat.numel() != int(self.total_lengths.sum()):
            raise ValueError(
                f"expected {int(self.total_lengths.sum())} tokens (sum of total_lengths), got {tokens_flat.numel()}"
            )
        valid = self.input_index >= 0
        out = torch.full(self.input_index.shape, pad_id, dtype=tokens_flat.dtype, device=tokens_flat.device)
        out[valid] = tokens_flat[self.input_index[valid]]
        if self.qkv_format == "bshd":
            return self._rows(out)
        return out

    def local_position_ids(self) -> torch.Tensor:
        if self.qkv_format == "bshd":
            return self._rows(self.position_ids)
        return self.position_ids

    def _rows(self, flat: torch.Tensor) -> torch.Tensor:
        """bshd: ``[S, local_seq_len]`` (``[0, 0]`` for a micro-batch with no sample)."""
        return flat.view(self.num_samples, -1) if self.num_samples else flat.view(0, 0)

    def targets(self, tokens_flat: torch.Tensor) -> torch.Tensor:
        """Token ids predicted at each local response position."""
        return tokens_flat[self.target_index]


def build_response_layout(
    total_lengths: Sequence[int] | torch.Tensor,
    response_lengths: Sequence[int] | torch.Tensor,
    *,
    cp_rank: int = 0,
    cp_size: int = 1,
    qkv_format: str = "thd",
    max_seq_len: Optional[int] = None,
) -> ResponseLayout:
    """The zigzag layout of one micro-batch for one CP rank (see module docstring)."""
    total = _as_long(total_lengths)
    resp = _as_long(response_lengths)
    if total.numel() != resp.numel():
        raise ValueError(f"{total.numel()} total_lengths but {resp.numel()} response_lengths")
    prompt = total - resp
    bad = torch.nonzero(prompt < 1).flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"sample {i}: response_length={int(resp[i])} leaves no prompt token in total_length={int(total[i])} "
            "(the first log-prob is predicted from the last prompt token)"
        )
    padded = padded_lengths(total, cp_size, qkv_format, max_seq_len)
    starts, lengths = zigzag_chunks(padded, cp_rank, cp_size)  # [S, 2]
    ends = starts + lengths
    local_len = lengths.sum(1)
    if qkv_format == "bshd":
        local_off = torch.arange(total.numel()) * (local_len[0] if total.numel() else 0)
    else:
        local_off = exclusive_cumsum(local_len)
    chunk_local_off = torch.stack([local_off, local_off + lengths[:, 0]], 1)

    # Response log-prob positions [P-1, T-1) intersected with each chunk.
    lo = (prompt - 1).unsqueeze(1)
    hi = (total - 1).unsqueeze(1)
    a = torch.maximum(starts, lo)
    b = torch.maximum(a, torch.minimum(ends, hi))
    n = (b - a).reshape(-1)
    resp_off = exclusive_cumsum(resp).unsqueeze(1)
    tok_off = exclusive_cumsum(total).unsqueeze(1)
    sample_ids = segment_ids(n) // 2  # n: per (sample, chunk), two chunks per sample
    resp_index = expand_runs((resp_off + a - lo).reshape(-1), n)
    logit_index = expand_runs((chunk_local_off + a - starts).reshape(-1), n)
    target_index = expand_runs((tok_off + a + 1).reshape(-1), n)

    # Model input: every local position, -1 where it is padding.
    positions = expand_runs(starts.reshape(-1), lengths.reshape(-1))
    owner = segment_ids(local_len)
    input_index = torch.where(positions < total[owner], tok_off.squeeze(1)[owner] + positions, -1)

    return ResponseLayout(
        cp_rank=cp_rank,
        cp_size=cp_size,
        qkv_format=qkv_format,
        total_lengths=total,
        response_lengths=resp,
        padded_lengths=padded,
        local_lengths=local_len,
        resp_index=resp_index,
        logit_index=logit_index,
        target_index=target_index,
        sample_ids=sample_ids,
        input_index=input_index,
        position_ids=positions,
    )


def all_rank_layouts(
    total_lengths, response_lengths, *, cp_size: int, qkv_format: str = "thd", max_seq_len: Optional[int] = None
) -> list[ResponseLayout]:
    """The layouts of every CP rank of a micro-batch (what the gather back needs)."""
    return [
        build_response_layout(
            total_lengths, response_lengths, cp_rank=r, cp_size=cp_size, qkv_format=qkv_format, max_seq_len=max_seq_len
        )
        for r in range(cp_size)
    ]


def segment_grid(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed stream's segments as rows of a padded grid: ``(gather, valid)``, both ``[S, L]``
    with ``L`` the longest segment. Row ``s``, column ``j`` reads packed position
    ``cu_seqlens[s] + j`` where ``valid`` (``j < len_s``), else position 0 (a placeholder: padding
    sits after a row's real tokens, so causal attention of real tokens never reads it).
    ``x[gather]`` pads, ``y[valid]`` unpads in packed order (segments are contiguous, in order)."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    width = int(lengths.max()) if lengths.numel() else 0
    col = torch.arange(width, device=cu.device)
    valid = col.unsqueeze(0) < lengths.unsqueeze(1)
    gather = torch.where(
        valid, cu[:-1].unsqueeze(1) + col.unsqueeze(0), torch.zeros((), dtype=torch.long, device=cu.device)
    )
    return gather, valid


def padded_attention_is_cheaper(cu_seqlens: torch.Tensor) -> bool:
    """Attention over the padded grid (``S * L^2`` scores) rather than over the whole packed
    stream with a block-diagonal mask (``t^2`` scores): true unless one long segment dominates."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    if lengths.numel() == 0:
        return False
    total, width = int(lengths.sum()), int(lengths.max())
    return lengths.numel() * width * width <= total * total
