"""rl_plugin.invariant.log_softmax: a row's log-probs do not depend on the row count, offset, threads,
vocab padding or a vocab-parallel split; the values are torch.log_softmax(logits / T)'s to fp32."""

import torch

from rl_plugin.invariant.log_softmax import (
    VOCAB_BLOCK,
    log_softmax,
    log_softmax_combine,
    log_softmax_partials,
    scale_logits,
    token_log_probs,
)
from tests.fast.invariant.conftest import with_threads

V = 1000  # not a multiple of the block: the last block is padded


def _logits(rows=100, seed=0):
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 4


def test_row_alone_equals_row_in_any_batch(threads):
    z = _logits()
    full = log_softmax(z, 0.7)
    for rows in range(1, 65):
        for offset in (0, 9, 36):
            assert torch.equal(log_softmax(z[offset : offset + rows], 0.7), full[offset : offset + rows]), (
                rows,
                offset,
            )
    assert torch.equal(with_threads(1, log_softmax, z, 0.7), with_threads(2, log_softmax, z, 0.7))


def test_close_to_torch_and_token_form_is_the_same_bits():
    z = _logits()
    torch.testing.assert_close(log_softmax(z, 0.7), torch.log_softmax(z / 0.7, -1), rtol=1e-5, atol=1e-5)
    targets = torch.randint(0, V, (100,), generator=torch.Generator().manual_seed(3))
    assert torch.equal(token_log_probs(z, targets, 0.7), log_softmax(z, 0.7).gather(1, targets[:, None]).squeeze(1))


def test_padded_vocab_and_vocab_parallel_give_the_same_bits():
    z = _logits(rows=20)
    whole = log_softmax(z, 1.3)
    # a vocab padded with -inf logits (Megatron's padded vocab, masked) to 4 blocks more
    padded = torch.cat([z, torch.full((20, 4 * VOCAB_BLOCK + 24), -float("inf"))], 1)
    assert torch.equal(log_softmax(padded, 1.3)[:, :V], whole)
    # two ranks, shards split at a block boundary, partials gathered in vocab order
    cut = 4 * VOCAB_BLOCK
    scaled = scale_logits(z, 1.3)
    parts = [log_softmax_partials(scaled[:, :cut]), log_softmax_partials(scaled[:, cut:])]
    lse = log_softmax_combine(torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1))
    assert torch.equal(scaled - lse[:, None], whole)
