"""Vocab-parallel log-probs / entropy (TP=2, odd vocab) equal the full-vocab ones, gradients too;
chunking and temperature; the fp32 LM head against an fp64 reference."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.loss import fp32_output_projection, log_probs_and_entropy
from rl_plugin.parallel import ParallelState
from tests.support import reference as ref
from tests.support.tolerance import FP32_LOSS_CORE, FP32_MODEL, FP64, tensor_within

VOCAB = 37  # odd: the TP shards are uneven (19 + 18)
ROWS = 11


def _data(dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(ROWS, VOCAB, generator=g, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=g)
    targets[0], targets[1] = 0, VOCAB - 1  # both shard edges
    w_lp = torch.randn(ROWS, generator=g, dtype=torch.float64)
    w_ent = torch.randn(ROWS, generator=g, dtype=torch.float64)
    return logits.to(dtype), targets, w_lp, w_ent


def _scale(temperature) -> float:
    """Magnitude of the terms of log_softmax(z / T): max |z| / T plus log V (the log-sum-exp); the
    rounding of log-probs, entropies and their gradients scales with it, not with each result."""
    logits = _data()[0]
    return float(logits.abs().max()) / temperature + float(torch.log(torch.tensor(float(VOCAB))))


def _reference(temperature):
    logits, targets, w_lp, w_ent = _data()
    leaf = logits.clone().requires_grad_(True)
    lp, ent = ref.log_softmax_entropy(leaf, targets, temperature)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    return lp.detach(), ent.detach(), leaf.grad


def _tp_worker(rank, world, temperature, chunk):
    ps = ParallelState.from_world(tp=world, cp=1, dp=1)
    logits, targets, w_lp, w_ent = _data()
    bounds = torch.linspace(0, VOCAB, world + 1).round().long().tolist()
    lo, hi = bounds[rank], bounds[rank + 1]
    shard = logits[:, lo:hi].clone().requires_grad_(True)
    lp, ent = log_probs_and_entropy(
        shard, targets, temperature=temperature, tp_group=ps.tp_group, vocab_start=lo, chunk_size=chunk
    )
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    return lp.detach(), ent.detach(), shard.grad, (lo, hi)


@pytest.mark.parametrize("temperature,chunk", [(1.0, 4), (0.7, 1024)])
def test_tp2_vocab_parallel_matches_full_vocab(run_world, temperature, chunk):
    lp_ref, ent_ref, grad_ref = _reference(temperature)
    results = run_world(_tp_worker, 2, temperature, chunk)
    tol = FP64 * _scale(temperature)
    for lp, ent, grad, (lo, hi) in results:
        assert lp.dtype == torch.float64
        assert float((lp - lp_ref).abs().max()) < tol
        assert float((ent - ent_ref).abs().max()) < tol
        assert float((grad - grad_ref[:, lo:hi]).abs().max()) < tol, f"shard [{lo}, {hi}) gradient"
    assert results[0][3] != results[1][3]


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_single_process_chunking_and_grad(chunk):
    lp_ref, ent_ref, grad_ref = _reference(1.3)
    logits, targets, w_lp, w_ent = _data()
    leaf = logits.clone().requires_grad_(True)
    lp, ent = log_probs_and_entropy(leaf, targets, temperature=1.3, chunk_size=chunk)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    lp, ent = lp.detach(), ent.detach()
    tol = FP64 * _scale(1.3)
    assert float((lp - lp_ref).abs().max()) < tol
    assert float((ent - ent_ref).abs().max()) < tol
    assert float((leaf.grad - grad_ref).abs().max()) < tol
    # fp32 logits: fp32 math, within fp32 rounding of the fp64 reference
    lp32, ent32 = log_probs_and_entropy(logits.float(), targets, temperature=1.3, chunk_size=chunk)
    assert lp32.dtype == torch.float32
    tol32 = FP32_LOSS_CORE * _scale(1.3)
    assert float((lp32.double() - lp_ref).abs().max()) < tol32
    assert float((ent32.double() - ent_ref).abs().max()) < tol32


def test_temperature_makes_ratio_one_on_sampling_weights():
    """Log-probs at the sampler's temperature equal the sampler's: exp(logp - old) == 1."""
    logits, targets, _, _ = _data(torch.float32)
    sampler = torch.log_softmax(logits / 0.6, -1).gather(1, targets.unsqueeze(1)).squeeze(1)
    lp, _ = log_probs_and_entropy(logits, targets, temperature=0.6, with_entropy=False)
    # two fp32 log-softmaxes of the same logits: |logp - old| ~ u * (max|z| / T + log V)
    assert float(torch.exp(lp - sampler).sub(1).abs().max()) < FP32_LOSS_CORE * _scale(0.6)
    lp1, _ = log_probs_and_entropy(logits, targets, temperature=1.0, with_entropy=False)
    assert float((lp1 - sampler).abs().max()) > 1e-2  # the wrong temperature is visibly off


def test_bad_inputs_raise():
    logits, targets, _, _ = _data(torch.float32)
    with pytest.raises(ValueError, match="temperature"):
        log_probs_and_entropy(logits, targets, temperature=0.0)
    with pytest.raises(ValueError, match="expected logits"):
        log_probs_and_entropy(logits, targets[:-1])


def test_fp32_lm_head_grad_matches_fp64_and_reaches_bf16_weight():
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 16, generator=g).to(torch.bfloat16).requires_grad_(True)
    weight = (0.2 * torch.randn(VOCAB, 16, generator=g)).to(torch.bfloat16).requires_grad_(True)
    upstream = torch.randn(6, VOCAB, generator=g, dtype=torch.float64)
    logits = fp32_output_projection(hidden, weight)
    assert logits.dtype == torch.float32
    (logits.double() * upstream).sum().backward()
    h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    (torch.matmul(h64, w64.t()) * upstream).sum().backward()
    assert weight.grad is not None and weight.grad.dtype == torch.bfloat16
    # fp32 accumulation: only the final rounding to bf16 remains (<= 2^-8 relative)
    rel = float(((weight.grad.double() - w64.grad).abs() / w64.grad.abs().clamp_min(1e-3)).max())
    assert rel < 2**-7, rel
    assert tensor_within(logits, torch.matmul(h64, w64.t()).detach(), rtol=FP32_MODEL)  # one length-16 fp32 contraction
    before = weight.detach().clone()
    torch.optim.SGD([weight], lr=0.5).step()
    assert not torch.equal(before, weight.detach()), "the bf16 weight must change after a step"


def test_fp32_lm_head_accumulates_into_main_grad_in_fp32():
    """Under Megatron DDP the fp32 gradient goes straight into main_grad (no bf16 rounding)."""
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(4, 8, generator=g).to(torch.bfloat16)
    weight = (0.2 * torch.randn(VOCAB, 8, generator=g)).to(torch.bfloat16).requires_grad_(True)
    weight.main_grad = torch.zeros(VOCAB, 8, dtype=torch.float32)
    upstream = torch.randn(4, VOCAB, generator=g)
    (fp32_output_projection(hidden, weight) * upstream).sum().backward()
    expected = upstream.t().double() @ hidden.double()
    assert weight.grad_added_to_main_grad is True
    assert tensor_within(weight.main_grad, expected, rtol=FP32_MODEL)  # length-4 fp32 sums of exact bf16 products
    assert float(weight.grad.abs().max()) == 0.0
