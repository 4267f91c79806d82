"""rl_plugin.invariant.linear: a row's bits do not depend on the row count, its offset, the thread
count, or a column / K split across tensor-parallel ranks; the values are F.linear's to fp32."""

import pytest
import torch
import torch.nn.functional as F

from rl_plugin.invariant.linear import K_PARTS, combine_partials, linear, linear_partials
from tests.fast.invariant.conftest import with_threads

K, N = 96, 80


def _data(rows=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, K, generator=g),
        torch.randn(N, K, generator=g) / K**0.5,
        torch.randn(N, generator=g),
    )


def test_row_alone_equals_row_in_any_batch_at_any_offset(threads):
    x, w, b = _data()
    full = linear(x, w, b)
    for rows in range(1, 65):
        for offset in (0, 5, 36):
            got = linear(x[offset : offset + rows], w, b)
            assert torch.equal(got, full[offset : offset + rows]), (rows, offset)


def test_one_and_two_threads_and_leading_dims_give_the_same_bits():
    x, w, b = _data()
    one = with_threads(1, linear, x, w, b)
    two = with_threads(2, linear, x, w, b)
    assert torch.equal(one, two)
    assert torch.equal(linear(x.view(4, 25, K), w, b).view(100, N), one)


def test_close_to_f_linear_and_differentiable():
    x, w, b = _data()
    x.requires_grad_(True)
    out = linear(x, w, b)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    grad = x.grad.clone()
    x.grad = None
    F.linear(x, w, b).square().sum().backward()
    torch.testing.assert_close(grad, x.grad, rtol=1e-4, atol=1e-4)


def test_column_and_row_parallel_splits_give_the_tp1_bits():
    x, w, b = _data(rows=37)
    whole = linear(x, w, b)
    columns = torch.cat([linear(x, w[: N // 2], b[: N // 2]), linear(x, w[N // 2 :], b[N // 2 :])], dim=1)
    assert torch.equal(columns, whole)
    # row parallel, TP2: each rank holds a contiguous K half and computes K_PARTS / 2 partials
    half = K // 2
    shards = [
        linear_partials(
            x[:, r * half : (r + 1) * half].contiguous(), w[:, r * half : (r + 1) * half].contiguous(), K_PARTS // 2
        )
        for r in range(2)
    ]
    gathered = torch.cat(shards, dim=0)  # all_gather in rank order
    assert torch.equal(combine_partials(gathered, b), whole)
    assert torch.equal(combine_partials(linear_partials(x, w), b), whole)


def test_a_k_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="K=5"):
        linear(torch.ones(2, 5), torch.ones(3, 5))


@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (576, 49152)], ids=["mlp_up", "mlp_down", "lm_head"])
def test_real_model_shapes_are_row_invariant_with_1_and_2_threads(k, n):
    """SmolLM2-135M's projection and LM-head shapes, where F.linear's kernel changes with the row
    count (1-3 rows, and 5-11 with 2 threads, differ from a larger batch on this CPU)."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(300, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    counts = (1, 2, 3, 5, 7, 9, 11, 16, 17, 64, 300) if n < 10000 else (1, 3, 7, 17)
    full = with_threads(2, linear, x[: max(counts)], w)
    for threads in (1, 2):
        for rows in counts:
            got = with_threads(threads, linear, x[:rows], w)
            assert torch.equal(got, full[:rows]), (threads, rows)


@pytest.mark.parametrize("n", [16, 8, 2, 1])
def test_a_narrow_column_shard_gives_the_whole_weights_bits(threads, n):
    """The embedded model's untied head (vocab 16, hidden 64) column-split over TP2 is 8 columns per
    rank: below 12 columns MKL takes another kernel (2.4e-7 off before ``MIN_COLS``, the TP2 loop's
    7.2e-7 log-prob gap of issue 45); every shard of ``n`` columns now has the 16-column bits."""
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(40, 64, generator=g), torch.randn(16, 64, generator=g) / 8, torch.randn(16, generator=g)
    whole = linear(x, w, b)
    shards = torch.cat([linear(x, w[i : i + n], b[i : i + n]) for i in range(0, 16, n)], dim=1)
    assert torch.equal(shards, whole), float((shards - whole).abs().max())
    parts = torch.cat([linear_partials(x, w[i : i + n]) for i in range(0, 16, n)], dim=-1)
    assert torch.equal(combine_partials(parts, b), whole)
