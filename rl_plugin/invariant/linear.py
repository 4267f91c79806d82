"""Batch-invariant linear layer: ``y = x @ W^T (+ b)`` with one fixed GEMM shape per call.

Tiling (the contract, identical in the engine and the trainer):

- rows: ``x``'s rows (all leading dims flattened) are zero-padded up to a multiple of
  ``ROW_TILE`` = 16 and viewed as ``[n_tiles, 16, K]``; every product is a ``torch.bmm`` whose
  batch entries are GEMMs of one shape ``(16, K / K_PARTS) x (K / K_PARTS, N)``, so a row's bits
  do not depend on how many rows share the call or where the row sits (MKL picks its kernel by
  shape; ``F.linear`` on 1-3 rows, and on 5-11 rows with 2 threads, takes another kernel and
  differs by ~2e-6 here).
- K: split into ``K_PARTS`` = 2 equal chunks; the chunk products ("partials") are added in chunk
  order, ``y = p_0 + p_1``, then ``+ b``. A row-parallel tensor-parallel layer (K sharded over
  ``tp`` ranks, ``tp`` dividing ``K_PARTS``) computes its ``K_PARTS / tp`` partials with
  ``linear_partials``, all-gathers them in rank order and calls ``combine_partials``: the same
  bits as TP1.
- N: every output column is one dot product over a K chunk, so a column split (column-parallel
  TP) gives the same bits as the whole ``N`` (checked by the tests), provided every GEMM has at
  least ``MIN_COLS`` = 16 columns: ``W`` with fewer output rows is zero-padded to 16 and the
  result sliced back (MKL takes another kernel below 12 columns and differs by ~2e-7 here: the
  embedded model's 16-token head split over TP2 is 8 columns per rank). ``N >= 16`` is untouched.

The default path (``torch.nn.functional.linear``) is not touched; these ops are only called by
modules patched by ``rl_plugin.invariant.hf_patch.make_invariant`` (and the Megatron true
on-policy path).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

ROW_TILE = 16  # rows per GEMM tile (padded with zeros)
MIN_COLS = 16  # fewest output columns per GEMM (a narrower weight is padded with zero rows)
K_PARTS = 2  # K chunks, combined in chunk order; row-parallel TP sizes dividing it reproduce TP1


def _tiles(x: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` zero-padded to ``[ceil(M / ROW_TILE), ROW_TILE, K]`` (at least one tile)."""
    rows = x.shape[0]
    tiles = max(1, -(-rows // ROW_TILE))
    if tiles * ROW_TILE != rows:
        x = F.pad(x, (0, 0, 0, tiles * ROW_TILE - rows))
    return x.reshape(tiles, ROW_TILE, x.shape[1])


def _chunk_products(x: torch.Tensor, weight: torch.Tensor, parts: int):
    """Yield the ``parts`` partials ``[M, N]`` of ``x [M, K] @ weight[N, K]^T``, chunk by chunk."""
    rows, k = x.shape
    if k != weight.shape[1] or k % parts:
        raise ValueError(
            f"linear: x has K={k}, weight {tuple(weight.shape)}; K must match and divide into {parts} parts"
        )
    tiles = _tiles(x)
    chunk = k // parts
    n = weight.shape[0]
    if n < MIN_COLS:
        weight = F.pad(weight, (0, 0, 0, MIN_COLS - n))
    cols = weight.shape[0]
    for p in range(parts):
        a = tiles[:, :, p * chunk : (p + 1) * chunk].contiguous()
        b = weight[:, p * chunk : (p + 1) * chunk].t().unsqueeze(0).expand(tiles.shape[0], chunk, cols)
        yield torch.bmm(a, b).reshape(-1, cols)[:rows, :n]


def linear_partials(x: torch.Tensor, weight: torch.Tensor, parts: int = K_PARTS) -> torch.Tensor:
    """The K-chunk partials ``[parts, ..., N]`` of ``x [..., K] @ weight[N, K]^T`` (chunk p uses
    columns ``[p K/parts, (p+1) K/parts)``), for a row-parallel shard: ``parts = K_PARTS / tp``."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    return torch.stack(list(_chunk_products(flat, weight, parts))).reshape(parts, *lead, weight.shape[0])


def combine_partials(partials: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``((p_0 + p_1) + ...) + bias`` over dim 0 of ``partials [P, ..., N]`` in index order (the
    all-gathered partials of every rank, rank order = K order)."""
    out = partials[0]
    for p in range(1, partials.shape[0]):
        out = out + partials[p]
    return out + bias if bias is not None else out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]^T + bias[N]`` -> ``[..., N]``, batch-invariant (see the module
    docstring): ``combine_partials(linear_partials(x, weight), bias)`` without the stacked copy."""
    lead = x.shape[:-1]
    out = None
    for partial in _chunk_products(x.reshape(-1, x.shape[-1]), weight, K_PARTS):
        out = partial if out is None else out + partial
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])
