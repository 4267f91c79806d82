"""rl_plugin.invariant.attention: the same bits for a query in decode (KV cache) and in a packed full
sequence, for any number of documents, offsets and 1/2 threads; the values are sdpa's to fp32."""

import torch
import torch.nn.functional as F

from rl_plugin.invariant.attention import attention, decode_attention, packed_positions
from tests.fast.invariant.conftest import with_threads

HQ, HKV, D = 4, 2, 16
LENGTHS = [5, 70, 130, 1, 64]  # across key blocks of 64, one-token and exactly-one-block documents


def _packed(seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    total = int(cu[-1])
    q, k, v = (torch.randn(total, h, D, generator=g) for h in (HQ, HKV, HKV))
    return cu, q, k, v


def _full(cu, q, k, v):
    starts, pos = packed_positions(cu, q.shape[0])
    return attention(q, k, v, starts, pos, D**-0.5)


def test_close_to_sdpa_per_document():
    cu, q, k, v = _packed()
    out = _full(cu, q, k, v)
    for i in range(len(LENGTHS)):
        s = slice(int(cu[i]), int(cu[i + 1]))
        qh, kh, vh = (t[s].transpose(0, 1)[None] for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[s], ref, rtol=1e-5, atol=1e-5)


def test_decode_against_a_cache_equals_the_full_sequence(threads):
    cu, q, k, v = _packed()
    full = _full(cu, q, k, v)
    batch, cache_len = len(LENGTHS), 160
    k_cache = torch.zeros(batch, cache_len, HKV, D)
    v_cache = torch.zeros(batch, cache_len, HKV, D)
    for step in range(max(LENGTHS)):
        live = [b for b, n in enumerate(LENGTHS) if step < n]  # a decode batch shrinks as docs end
        rows = torch.tensor([int(cu[b]) + step for b in live])
        k_cache[live, step], v_cache[live, step] = k[rows], v[rows]
        lengths = torch.full((len(live),), step + 1)
        got = decode_attention(q[rows], k_cache[live], v_cache[live], lengths, D**-0.5)
        assert torch.equal(got, full[rows]), step


def test_any_document_subset_offset_and_thread_count_gives_the_same_bits():
    cu, q, k, v = _packed()
    full = with_threads(2, _full, cu, q, k, v)
    assert torch.equal(with_threads(1, _full, cu, q, k, v), full)
    # the 130-token document alone (at offset 0), and a prefix of it (a shorter prefill)
    s, e = int(cu[2]), int(cu[3])
    alone = _full(torch.tensor([0, e - s]), q[s:e], k[s:e], v[s:e])
    assert torch.equal(alone, full[s:e])
    prefix = _full(torch.tensor([0, 77]), q[s : s + 77], k[s : s + 77], v[s : s + 77])
    assert torch.equal(prefix, full[s : s + 77])
    # one query at any position, alone against the whole stream
    for row in (s, s + 63, s + 64, s + 129):
        one = attention(q[row : row + 1], k, v, torch.tensor([s]), torch.tensor([row - s]), D**-0.5)
        assert torch.equal(one[0], full[row]), row
