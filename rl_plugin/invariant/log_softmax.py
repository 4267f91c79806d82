"""Batch-invariant log-softmax over the vocabulary in fixed blocks, and its vocab-parallel form.

For ``z = logits / T`` ([rows, V]; the vocab right-padded with -inf to a multiple of
``VOCAB_BLOCK`` = 128, block b = vocab ids ``[128 b, 128 b + 128)``):

    m_b = max(z in block b)                       (exact, order-free)
    s_b = sum(exp(z - m_b) in block b)            (a last-dim sum of 128 elements per row; 0 for
                                                   an all -inf block, whose m_b stays -inf)
    M   = max_b m_b
    S   = sum_b s_b * exp(m_b - M)                 in block order, one fp64 running sum
                                                   (``cumsum`` on CPU: a sequential loop)
    lse = M + log(S),   log_softmax(z) = z - lse

Each block sum has one fixed length whatever the row count, and the block combine is sequential,
so a row's bits depend only on its own logits: not on the number of rows, their order, 1 vs 2
threads, or trailing all-padding blocks (a padded vocab gives the same bits). Vocab-parallel: a
rank whose shard starts at a multiple of 128 computes ``log_softmax_partials`` of its shard,
the ``[rows, n_blocks]`` partials are all-gathered in rank (= vocab) order and
``log_softmax_combine`` gives the same ``lse`` as one rank.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

VOCAB_BLOCK = 128


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / T`` in fp32 (``x / 1.0`` is ``x`` exactly), the sampler's and the trainer's op."""
    return logits.to(torch.float32) / float(temperature)


def log_softmax_partials(scaled: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(m, s)`` ``[rows, n_blocks]`` of already-scaled logits ``scaled [rows, V_local]``."""
    rows, vocab = scaled.shape
    blocks = -(-vocab // VOCAB_BLOCK)
    if blocks * VOCAB_BLOCK != vocab:
        scaled = F.pad(scaled, (0, blocks * VOCAB_BLOCK - vocab), value=-float("inf"))
    z = scaled.view(rows, blocks, VOCAB_BLOCK)
    m = z.detach().amax(-1)  # a shift only: lse does not depend on it (no gradient through it)
    finite = torch.isfinite(m)
    shift = torch.where(finite, m, torch.zeros_like(m))
    s = torch.exp(z - shift[..., None]).sum(-1)  # an all -inf block: exp(-inf) = 0, s = 0
    return m, s


def log_softmax_combine(m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``lse [rows]`` from the block partials ``m, s [rows, n_blocks]`` (block order)."""
    top = m.amax(-1)
    weights = torch.exp(torch.where(torch.isfinite(m), m - top[:, None], torch.full_like(m, -float("inf"))))
    total = (s * weights).cumsum(-1)[:, -1]  # sequential, fp64 accumulation on CPU
    return top + torch.log(total)


def log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / T)`` ``[rows, V]`` (see the module docstring)."""
    scaled = scale_logits(logits, temperature)
    lse = log_softmax_combine(*log_softmax_partials(scaled))
    return scaled - lse[:, None]


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / T)[row, targets[row]]`` ``[rows]`` (the same bits as ``log_softmax``)."""
    scaled = scale_logits(logits, temperature)
    lse = log_softmax_combine(*log_softmax_partials(scaled))
    return scaled.gather(-1, targets[:, None]).squeeze(-1) - lse
