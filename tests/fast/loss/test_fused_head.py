"""The fused LM head + log-probs/entropy equals the unfused path (head matmul, then
``log_probs_and_entropy``): values and the gradients of hidden states and weight.

- fp64, one process and TP=2 (real gloo processes, uneven shards of an odd vocabulary),
  temperature != 1, entropy on and off, several chunk sizes: 1e-12.
- fp32 head on bf16 weights: both paths do the same fp32 arithmetic in a different order; the
  bound below comes from the error analysis of a length-H dot product and a length-V sum.
- bf16 head: both paths round the same logits to bf16; bound from that rounding.
- Megatron DDP: the fp32 weight gradient lands in ``main_grad``; tied embeddings: the shared
  weight gets the input-side and head-side gradients, as unfused.
- No ``[T, V]`` buffer: every tensor the fused fwd + bwd creates is recorded (dispatch mode).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rl_plugin.loss import fp32_output_projection, log_probs_and_entropy
from rl_plugin.loss.fused_head import default_chunk_rows, fused_log_probs_and_entropy
from rl_plugin.parallel import ParallelState
from tests.support.tolerance import FP32_MODEL

VOCAB, HID, ROWS = 37, 12, 23  # odd vocabulary: TP shards 18 + 19
TEMP = 0.7
EPS32 = 2.0**-24  # unit roundoff of fp32


def _data(dtype=torch.float64, seed=3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, HID, generator=g, dtype=torch.float64)
    weight = 0.8 * torch.randn(VOCAB, HID, generator=g, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=g)
    targets[:4] = torch.tensor([0, 17, 18, VOCAB - 1])  # both edges of both shards
    w_lp = torch.randn(ROWS, generator=g, dtype=torch.float64)
    w_ent = torch.randn(ROWS, generator=g, dtype=torch.float64)
    return hidden.to(dtype), weight.to(dtype), targets, w_lp, w_ent


def _run(fn, hidden, weight, targets, w_lp, w_ent, with_entropy):
    """(logp, entropy, d hidden, d weight) of J = sum w_lp logp + sum w_ent entropy."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = fn(h, w)
    j = (lp.double() * w_lp).sum() + ((ent.double() * w_ent).sum() if with_entropy else 0.0)
    j.backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _unfused(targets, with_entropy, temperature=TEMP, tp_group=None, vocab_start=0, fp32=False):
    def fn(h, w):
        logits = fp32_output_projection(h, w) if fp32 else h @ w.t()
        return log_probs_and_entropy(
            logits,
            targets,
            temperature=temperature,
            tp_group=tp_group,
            vocab_start=vocab_start,
            with_entropy=with_entropy,
        )

    return fn


def _fused(targets, with_entropy, temperature=TEMP, tp_group=None, vocab_start=0, fp32=False, chunk=None):
    def fn(h, w):
        return fused_log_probs_and_entropy(
            h,
            w,
            targets,
            temperature=temperature,
            tp_group=tp_group,
            vocab_start=vocab_start,
            fp32_head=fp32,
            chunk_size=chunk,
            with_entropy=with_entropy,
        )

    return fn


def _max_err(a, b):
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("chunk", [1, 5, None])
def test_fp64_fused_equals_unfused(with_entropy, chunk):
    h, w, t, w_lp, w_ent = _data()
    ref = _run(_unfused(t, with_entropy), h, w, t, w_lp, w_ent, with_entropy)
    got = _run(_fused(t, with_entropy, chunk=chunk), h, w, t, w_lp, w_ent, with_entropy)
    assert got[0].dtype == torch.float64
    assert _max_err(got, ref) < 1e-12, _max_err(got, ref)
    assert float(ref[3].abs().max()) > 1e-2 and float(ref[1].abs().max()) > (0.1 if with_entropy else -1)


def _tp_worker(rank, world):
    ps = ParallelState.from_world(tp=world, cp=1, dp=1)
    h, w, t, w_lp, w_ent = _data()
    bounds = torch.linspace(0, VOCAB, world + 1).round().long().tolist()
    lo, hi = bounds[rank], bounds[rank + 1]
    out = {}
    for with_entropy in (True, False):
        fn = _fused(t, with_entropy, tp_group=ps.tp_group, vocab_start=lo, chunk=4)
        out[with_entropy] = _run(fn, h, w[lo:hi], t, w_lp, w_ent, with_entropy)
    return out, (lo, hi)


def test_tp2_fused_equals_unfused_full_vocab(run_world):
    """Each rank holds an uneven vocab shard; log-probs, entropy and d(hidden) (all-reduced) equal
    the single-process unfused values, d(weight shard) the matching rows of the full gradient."""
    h, w, t, w_lp, w_ent = _data()
    results = run_world(_tp_worker, 2)
    assert results[0][1] == (0, 18) and results[1][1] == (18, 37)
    for with_entropy in (True, False):
        lp, ent, gh, gw = _run(_unfused(t, with_entropy), h, w, t, w_lp, w_ent, with_entropy)
        for out, (lo, hi) in results:
            assert _max_err(out[with_entropy], (lp, ent, gh, gw[lo:hi])) < 1e-12, (with_entropy, lo)


def _fp32_bound(h, w):
    """|fp32 - exact| of a log-prob/entropy computed in fp32 (either path), doubled for a difference.

    Logits: a length-H dot product has error <= H u sum_k |h_k w_k| (u = 2^-24), divided by T.
    Log-sum-exp and the entropy's sums over V terms: <= (V + 4) u times their size, i.e. the
    largest |logit| plus log V. Gradients: the same relative error on p and on the logits,
    amplified by nothing larger than 1 (p <= 1): bounded relative to the gradient's norm.
    """
    h, w = h.detach().double(), w.detach().double()
    s = float((h.abs() @ w.abs().t()).max()) / TEMP
    zmax = float((h @ w.t()).abs().max()) / TEMP
    return 2 * ((HID * s) + (VOCAB + 4) * (zmax + torch.log(torch.tensor(float(VOCAB))).item())) * EPS32


@pytest.mark.parametrize("with_entropy", [True, False])
def test_fp32_head_on_bf16_weight(with_entropy):
    h64, w64, t, w_lp, w_ent = _data()
    h, w = h64.to(torch.bfloat16), w64.to(torch.bfloat16)
    ref = _run(_unfused(t, with_entropy, fp32=True), h, w, t, w_lp, w_ent, with_entropy)
    got = _run(_fused(t, with_entropy, fp32=True, chunk=4), h, w, t, w_lp, w_ent, with_entropy)
    assert got[0].dtype == torch.float32 and got[2].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16
    bound = _fp32_bound(h, w)
    assert _max_err(got[:2], ref[:2]) < bound, (_max_err(got[:2], ref[:2]), bound)
    # Gradients are returned in bf16: both round the same fp32 value (within the bound) to bf16,
    # so they agree within one bf16 ulp (2^-8 relative) of the largest entry plus the bound.
    for a, b in zip(got[2:], ref[2:]):
        scale = float(b.double().abs().max())
        assert float((a.double() - b.double()).abs().max()) <= 2**-8 * scale + bound * scale


def test_bf16_head_rounds_logits_like_the_model():
    """Without the fp32 head the head runs in bf16 (as the model's own output layer): the same
    bf16-rounded logits feed the fp32 softmax, so log-probs agree within the rounding of the two
    matmuls' fp32 accumulations to bf16 (2^-8 relative of |logit|, each side)."""
    h64, w64, t, w_lp, w_ent = _data()
    h, w = h64.to(torch.bfloat16), w64.to(torch.bfloat16)
    ref = _run(_unfused(t, True), h, w, t, w_lp, w_ent, True)
    got = _run(_fused(t, True, chunk=4), h, w, t, w_lp, w_ent, True)
    zmax = float((h.double() @ w.double().t()).abs().max()) / TEMP
    assert _max_err(got[:2], ref[:2]) < 4 * 2**-8 * zmax


def test_weight_gradient_goes_to_main_grad_in_fp32():
    h64, w64, t, w_lp, w_ent = _data()
    h, w = h64.to(torch.bfloat16), w64.to(torch.bfloat16).requires_grad_(True)
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    lp, ent = fused_log_probs_and_entropy(h, w, t, temperature=TEMP, fp32_head=True, chunk_size=4)
    ((lp.double() * w_lp).sum() + (ent.double() * w_ent).sum()).backward()
    _, _, _, gw64 = _run(_unfused(t, True), h.double(), w.detach().double(), t, w_lp, w_ent, True)
    assert w.grad_added_to_main_grad is True and float(w.grad.abs().max()) == 0.0
    err = float((w.main_grad.double() - gw64).abs().max()) / float(gw64.abs().max())
    assert err < 64 * _fp32_bound(h, w), err  # fp32 accumulation: far below bf16's 2^-8
    assert err < 2**-12


def test_tied_embedding_gets_both_gradients():
    """A weight used as input embedding AND head: its gradient is the sum of both uses."""
    _, w, t, w_lp, w_ent = _data()
    ids = torch.randint(0, VOCAB, (ROWS,), generator=torch.Generator().manual_seed(9))
    mix = torch.randn(HID, HID, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    grads = []
    for fn in (_unfused(t, True), _fused(t, True, chunk=3)):
        shared = w.clone().requires_grad_(True)
        hidden = torch.tanh(shared[ids] @ mix)
        lp, ent = fn(hidden, shared)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        grads.append(shared.grad)
    assert float((grads[0] - grads[1]).abs().max()) < 1e-12
    input_only = torch.zeros(VOCAB, dtype=torch.bool)
    input_only[ids] = True
    assert float(grads[1][~input_only].abs().max()) > 0  # rows reached only through the head


class _RecordNumel(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.largest = max(self.largest, o.numel())
        return out


def test_no_tensor_of_size_tokens_by_vocab():
    rows, vocab, hid, chunk = 64, 97, 8, 4
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hid, generator=g).requires_grad_(True)
    w = torch.randn(vocab, hid, generator=g).requires_grad_(True)
    t = torch.randint(0, vocab, (rows,), generator=g)
    with _RecordNumel() as rec:
        lp, ent = fused_log_probs_and_entropy(h, w, t, temperature=TEMP, chunk_size=chunk)
        (lp.sum() + ent.sum()).backward()
    # blocks of chunk x vocab (forward) and rows x (chunk * vocab / rows) (backward); inputs
    # and their gradients are rows x hid and vocab x hid
    assert rec.largest <= max(chunk * vocab, rows * hid, vocab * hid), rec.largest
    with _RecordNumel() as rec:
        lp, ent = _unfused(t, True)(h, w)
    assert rec.largest == rows * vocab  # what the fused path avoids (the check can see it)


def test_default_chunk_bounds_the_block():
    assert default_chunk_rows(32000) == 65 and default_chunk_rows(152064) == 13
    assert default_chunk_rows(10**9) == 1


def test_bad_inputs_raise():
    h, w, t, _, _ = _data(torch.float32)
    with pytest.raises(ValueError, match="temperature"):
        fused_log_probs_and_entropy(h, w, t, temperature=0.0)
    with pytest.raises(ValueError, match="expected hidden"):
        fused_log_probs_and_entropy(h, w[:, :-1], t)
    with pytest.raises(ValueError, match="expected targets"):
        fused_log_probs_and_entropy(h, w, t[:-1])
    with pytest.raises(ValueError, match="chunk_size"):
        fused_log_probs_and_entropy(h, w, t, chunk_size=0)


@pytest.mark.parametrize("tied", [False, True])
def test_hf_model_fused_head_equals_its_logits(tiny_checkpoint, tied):
    """FSDP backend's head, one process (fp32 HF model): log-probs, entropy and every parameter's
    gradient with ``FusedLogProbHead`` equal those from the model's own logits, for the packed
    (thd) and padded (bshd, rows picked by the head) layouts; a tied embedding stays tied.
    fp32 bound: both sides run the same fp32 model and differ only in the head's summation
    order, O(H u) relative on logits of size ~5: ``tolerance.FP32_MODEL``, as the whole-step parity tests."""
    from rl_plugin.backends.fsdp.model import FusedLogProbHead, install_fused_head, load_hf_model
    from rl_plugin.backends.fsdp.packing import micro_batch_log_probs
    from rl_plugin.loss import ForwardOptions, MicroBatchInputs
    from tests.support.fsdp_common import make_step, rel_err, step_batch

    ckpt = tiny_checkpoint(tie_word_embeddings=tied)
    batch = step_batch(make_step(4))
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = (
        torch.randn(int(batch.response_lengths.sum()), generator=g),
        torch.randn(int(batch.response_lengths.sum()), generator=g),
    )
    for qkv in ("thd", "bshd"):
        mb = MicroBatchInputs.build(batch, qkv_format=qkv, max_seq_len=32 if qkv == "bshd" else None)
        out = []
        for fused in (False, True):
            model = load_hf_model(ckpt, attn_implementation="eager")
            if fused:
                install_fused_head(model, fp32=False)
                assert isinstance(model.lm_head, FusedLogProbHead)
            assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
            opts = ForwardOptions(temperature=TEMP, chunk_size=5, with_entropy=True)
            lp, ent = micro_batch_log_probs(model, mb, opts, "eager", torch.device("cpu"))
            idx = mb.layout.resp_index
            ((lp * w_lp[idx]).sum() + (ent * w_ent[idx]).sum()).backward()
            out.append((lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (lp0, ent0, g0), (lp1, ent1, g1) = out
        assert rel_err(lp1, lp0) < FP32_MODEL and rel_err(ent1, ent0) < FP32_MODEL, qkv
        for name, grad in g0.items():
            assert rel_err(g1[name], grad) < FP32_MODEL, (qkv, name, rel_err(g1[name], grad))


def test_sync_free_target_term_equals_the_nonzero_path():
    """The CUDA path of the backward's target term (no ``nonzero`` host sync: every row adds, 0
    where its target is outside the block) equals the CPU path, block by block, with ids at the
    block edges and outside every block."""
    from rl_plugin.loss.fused_head import add_target_term

    g0 = torch.Generator().manual_seed(3)
    rows, v_local, width = 37, 50, 16
    local_t = torch.randint(-5, v_local + 5, (rows,), generator=g0)
    local_t[:4] = torch.tensor([0, 15, 16, v_local - 1])
    a_target = torch.randn(rows, generator=g0, dtype=torch.float64)
    for v0 in range(0, v_local, width):
        v1 = min(v0 + width, v_local)
        block = torch.randn(rows, v1 - v0, generator=g0, dtype=torch.float64)
        ref, got = block.clone(), block.clone()
        add_target_term(ref, local_t, a_target, v0, v1, sync_free=False)
        add_target_term(got, local_t, a_target, v0, v1, sync_free=True)
        assert torch.equal(ref, got)
        assert not torch.equal(ref, block) or not ((local_t >= v0) & (local_t < v1)).any()


def test_default_chunk_is_device_aware():
    from rl_plugin.loss.fused_head import CUDA_CHUNK_ELEMENTS, DEFAULT_CHUNK_ELEMENTS

    assert default_chunk_rows(151_936, device="cpu") == DEFAULT_CHUNK_ELEMENTS // 151_936 == 13
    assert default_chunk_rows(151_936, device="cuda") == CUDA_CHUNK_ELEMENTS // 151_936 == 441
    assert default_chunk_rows(151_936) == 13  # no device: the CPU setting, as before
