"""Batch- and position-invariant causal attention: one function for the packed full sequence and
for decode against a KV cache.

A query is described by its document: ``key_start`` (the index in ``k`` / ``v`` of the
document's key at position 0) and ``q_pos`` (its position; it attends the document's keys
``0..q_pos``). Tiling (the contract):

- query tiles: the queries of one document are grouped by ``q_pos // ROW_TILE`` into tiles of
  ``ROW_TILE`` = 16 rows (row ``q_pos % 16``, the missing rows zeros); a decode query is its own
  tile. A kv head's G = Hq / Hkv query heads stack their 16 rows into one ``G * 16``-row tile, so
  every score and value product is a batched GEMM of one shape per model: ``(16 G, d) x (d, 64)``
  for the scores, ``(16 G, 64) x (64, d)`` for ``P V``.
- key blocks: ``KEY_BLOCK`` = 64 keys aligned to the document's position 0 (block j = positions
  ``[64 j, 64 j + 64)``); keys after ``q_pos`` are masked to -inf (their probability is exactly 0).
- online softmax over the blocks in order j = 0, 1, ..., per (query, head):

      s_j   = (q . k) * scale        (masked: -inf)
      m'    = max(m, max(s_j)),  c = exp(m - m'),  p_j = exp(s_j - m')
      l     = l * c + sum(p_j)       (a last-dim sum of 64 elements)
      acc   = acc * c + p_j @ V_j
      out   = acc / l

  A block past a query's position (the full sequence runs as many blocks as its longest query
  needs) is an exact no-op for it: m' = m, c = exp(0) = 1, p_j = 0, so l and acc keep their bits.

So a query's output depends only on its own q, its document's keys/values up to its position and
its position modulo the tiles: the same bits in decode (a KV cache, one query) and in a packed
full-sequence forward, for any number of queries or documents and 1 or 2 threads. GQA: query head
h reads kv head ``h // (Hq / Hkv)`` (HF's ``repeat_kv`` order). Sliding windows are not supported.
"""

from __future__ import annotations

import torch

ROW_TILE = 16
KEY_BLOCK = 64


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_start: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention ``[N, Hq, d]`` of queries ``q [N, Hq, d]`` over ``k, v [M, Hkv, d]``;
    ``key_start, q_pos [N]`` (long) as in the module docstring (every ``key_start + q_pos < M``)."""
    n, heads, dim = q.shape
    keys, kv_heads, _ = k.shape
    groups = heads // kv_heads
    device = q.device
    tile_of = torch.stack([key_start, torch.div(q_pos, ROW_TILE, rounding_mode="floor")], 1)
    tiles, inverse = torch.unique(tile_of, dim=0, return_inverse=True)
    n_tiles, rows = tiles.shape[0], groups * ROW_TILE
    row = q_pos % ROW_TILE
    packed = q.new_zeros(n_tiles, ROW_TILE, heads, dim).index_put((inverse, row), q)
    # [tiles, Hkv, G * 16, d]: a kv head's G query heads x 16 rows share one GEMM per key block
    packed = (
        packed.view(n_tiles, ROW_TILE, kv_heads, groups, dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(n_tiles, kv_heads, rows, dim)
    )
    # the position each tile row stands for (padding rows: a valid position too, so no row is all -inf)
    row_pos = (tiles[:, 1:2] * ROW_TILE + torch.arange(ROW_TILE, device=device)).repeat(1, groups)  # [tiles, G * 16]
    blocks = int(q_pos.max()) // KEY_BLOCK + 1 if n else 0
    m = q.new_full((n_tiles, kv_heads, rows), -float("inf"))
    denom = q.new_zeros(n_tiles, kv_heads, rows)
    acc = q.new_zeros(n_tiles, kv_heads, rows, dim)
    for j in range(blocks):
        offsets = j * KEY_BLOCK + torch.arange(KEY_BLOCK, device=device)  # document positions
        index = (tiles[:, :1] + offsets).clamp(max=keys - 1)  # [tiles, 64]; past the end: masked
        k_blk = k[index].permute(0, 2, 3, 1)  # [tiles, Hkv, d, 64]
        v_blk = v[index].transpose(1, 2)  # [tiles, Hkv, 64, d]
        scores = torch.matmul(packed, k_blk) * scale  # [tiles, Hkv, G * 16, 64]
        allowed = (offsets[None, None, :] <= row_pos[:, :, None])[:, None]  # [tiles, 1, G * 16, 64]
        scores = scores.masked_fill(~allowed, -float("inf"))
        m_new = torch.maximum(m, scores.amax(-1))
        correction = torch.exp(m - m_new)
        p = torch.exp(scores - m_new[..., None])
        denom = denom * correction + p.sum(-1)
        acc = acc * correction[..., None] + torch.matmul(p, v_blk)
        m = m_new
    out = (acc / denom[..., None]).view(n_tiles, kv_heads, groups, ROW_TILE, dim).permute(0, 3, 1, 2, 4)
    return out.reshape(n_tiles, ROW_TILE, heads, dim)[inverse, row]


def packed_positions(cu_seqlens: torch.Tensor, total: int):
    """``(key_start, q_pos) [total]`` of a packed stream of documents ``cu_seqlens [D + 1]``."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
    return starts, torch.arange(total, device=cu_seqlens.device) - starts


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    """One new query per sequence: ``q [B, Hq, d]`` at position ``lengths - 1`` against the cache
    ``k_cache, v_cache [B, L, Hkv, d]`` (its first ``lengths[b]`` keys valid) -> ``[B, Hq, d]``."""
    batch, length = k_cache.shape[:2]
    starts = torch.arange(batch, device=q.device) * length
    return attention(q, k_cache.flatten(0, 1), v_cache.flatten(0, 1), starts, lengths - 1, scale)
