"""The vectorised packed RoPE's tables (``rl_plugin.backends.megatron.compat.rope_thd``): the
frequency row of every packed position, and ``RopeTables``' cache of cos / sin per packed layout.
(Bitwise against megatron-core's own loop, in a real world: ``test_packed_attention.py``.)"""

from __future__ import annotations

import torch

from rl_plugin.backends.megatron.compat import rope_thd
from rl_plugin.backends.megatron.compat.rope_thd import RopeTables, packed_freq_rows

CU = torch.tensor([0, 3, 4, 7], dtype=torch.int32)


def test_rows_restart_per_sample_unless_the_table_is_per_position():
    assert packed_freq_rows(CU, num_rows=5).tolist() == [0, 1, 2, 0, 0, 1, 2]
    assert packed_freq_rows(CU, num_rows=7).tolist() == list(range(7))  # one row per packed position


def test_tables_are_megatrons_formula_cached_per_layout():
    freqs = torch.linspace(0.0, 3.0, 5 * 4).view(5, 1, 1, 4)  # megatron's [max_s, 1, 1, dim]
    tables = RopeTables()
    cos_, sin_ = tables.get(CU, freqs, 0.5, torch.float32, 1)
    rows = torch.tensor([0, 1, 2, 0, 0, 1, 2])
    assert torch.equal(cos_, torch.cos(freqs[rows]) * 0.5) and torch.equal(sin_, torch.sin(freqs[rows]) * 0.5)
    again = tables.get(CU.clone(), freqs, 0.5, torch.float32, 1)
    assert again[0] is cos_  # the same layout (equal values): no recomputation
    cos3, _ = tables.get(CU, freqs, 0.5, torch.float32, 3)
    assert cos3.shape == (7, 1, 3, 4) and cos3.is_contiguous() and torch.equal(cos3, cos_.expand(7, 1, 3, 4))
    two = torch.tensor([0, 2, 4], dtype=torch.int32)
    other = tables.get(two, freqs, 0.5, torch.float32, 1)[0]
    assert other is not cos_ and torch.equal(other[2], torch.cos(freqs[0]) * 0.5)  # a new layout: new rows
    half = tables.get(two, freqs, 0.5, torch.bfloat16, 1)[0]
    assert half.dtype == torch.bfloat16


def test_large_tables_are_not_expanded(monkeypatch):
    monkeypatch.setattr(rope_thd, "EXPAND_MAX_ELEMENTS", 10)
    freqs = torch.ones(5, 1, 1, 4)
    cos_, _ = RopeTables().get(CU, freqs, 1.0, torch.float32, 8)
    assert cos_.shape == (7, 1, 1, 4)  # 7 * 8 * 4 > 10: the broadcasting table is returned
