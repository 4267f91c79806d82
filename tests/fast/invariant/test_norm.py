"""rl_plugin.invariant.norm: RMSNorm's row bits do not depend on the row count, offset or threads,
and equal transformers' LlamaRMSNorm."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from rl_plugin.invariant.norm import rms_norm
from tests.fast.invariant.conftest import with_threads


def test_rows_alone_equal_rows_in_a_batch(threads):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(100, 576, generator=g), torch.randn(576, generator=g)
    full = rms_norm(x, w, 1e-5)
    for rows in range(1, 65):
        for offset in (0, 7, 36):
            assert torch.equal(rms_norm(x[offset : offset + rows], w, 1e-5), full[offset : offset + rows]), (
                rows,
                offset,
            )
    assert torch.equal(with_threads(1, rms_norm, x, w, 1e-5), with_threads(2, rms_norm, x, w, 1e-5))


def test_equals_transformers_rmsnorm():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 9, 64, generator=g)
    norm = LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
    torch.testing.assert_close(rms_norm(x, norm.weight, 1e-6), norm(x), rtol=1e-6, atol=1e-6)


def test_a_row_longer_than_one_thread_reduces_is_refused():
    with pytest.raises(ValueError, match="32769"):
        rms_norm(torch.ones(1, 32769), torch.ones(32769), 1e-6)
