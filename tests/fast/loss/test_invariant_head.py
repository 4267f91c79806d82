"""``invariant_log_probs_and_entropy`` (true on-policy mode's head): the op library's bits, the right
values and gradients, and under TP2 (real gloo processes) TP1's bits, for a vocabulary whose shards
are whole ``VOCAB_BLOCK`` blocks (the block-partials path) and one whose are not (gathered logits)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rl_plugin.loss.invariant_head import invariant_log_probs_and_entropy
from rl_plugin.loss.logprobs import TargetOutOfVocabError
from tests.support.tolerance import FP32_MODEL

T = 0.7


def _inputs(vocab: int, rows: int = 37, hidden: int = 32):
    g = torch.Generator().manual_seed(vocab)
    h = torch.randn(rows, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.5
    targets = torch.randint(0, vocab, (rows,), generator=g)
    a, b = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    return h, w, targets, a, b


def _grads(h, w, targets, a, b, **kw):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent = invariant_log_probs_and_entropy(h, w, targets, temperature=T, **kw)
    (a * logp + b * ent).sum().backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def test_tp1_gives_the_ops_bits_and_the_fp64_values_and_gradients():
    from rl_plugin import invariant as inv

    h, w, targets, a, b = _inputs(100)
    logp, ent, gh, gw = _grads(h, w, targets, a, b)
    ops = inv.log_softmax(inv.linear(h, w), T).gather(1, targets[:, None]).squeeze(1)
    assert torch.equal(logp, ops)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    ref = torch.log_softmax(h64 @ w64.t() / T, -1)
    ref_logp = ref.gather(1, targets[:, None]).squeeze(1)
    ref_ent = -(ref.exp() * ref).sum(-1)
    (a.double() * ref_logp + b.double() * ref_ent).sum().backward()
    assert float((logp.double() - ref_logp).abs().max()) < FP32_MODEL * float(ref_logp.abs().max())
    assert float((ent.double() - ref_ent).abs().max()) < FP32_MODEL * float(ref_ent.abs().max())
    for got, want in ((gh, h64.grad), (gw, w64.grad)):
        assert float((got.double() - want).abs().max()) < FP32_MODEL * float(want.abs().max())
    _, ent_off = invariant_log_probs_and_entropy(h, w, targets, temperature=T, with_entropy=False)
    assert torch.equal(ent_off, torch.zeros_like(ent_off))


def test_a_target_outside_the_vocabulary_fails_loud():
    h, w, targets, _, _ = _inputs(100)
    targets[5] = 100
    with pytest.raises(TargetOutOfVocabError, match="target token id 100 .*row 5.*vocabulary \\[0, 100\\)"):
        invariant_log_probs_and_entropy(h, w, targets, temperature=T)


class _CopyToGroup(torch.autograd.Function):
    """The caller's side (megatron's ``copy_to_tensor_model_parallel_region``): identity forward,
    all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def tp2_worker(rank, world, vocab):
    h, w, targets, a, b = _inputs(vocab)
    n = vocab // world
    one = _grads(h, w, targets, a, b)
    hh, ws = h.clone().requires_grad_(), w[rank * n : (rank + 1) * n].clone().requires_grad_()
    logp, ent = invariant_log_probs_and_entropy(
        _CopyToGroup.apply(hh), ws, targets, temperature=T, tp_group=dist.group.WORLD, vocab_start=rank * n
    )
    (a * logp + b * ent).sum().backward()
    return one, (logp.detach(), ent.detach(), hh.grad, ws.grad)


@pytest.mark.parametrize("vocab", [100, 256])  # shards of 50 (gathered logits), of 128 (block partials)
def test_tp2_gives_tp1s_bits_and_gradients(run_world, vocab):
    for rank, ((logp1, ent1, gh1, gw1), (logp, ent, gh, gw)) in enumerate(run_world(tp2_worker, 2, vocab)):
        assert torch.equal(logp, logp1), float((logp - logp1).abs().max())
        assert float((ent - ent1).abs().max()) < FP32_MODEL * float(ent1.abs().max())
        n = vocab // 2
        for got, want in ((gh, gh1), (gw, gw1[rank * n : (rank + 1) * n])):
            assert float((got - want).abs().max()) < FP32_MODEL * float(want.abs().max()), (rank, vocab)
