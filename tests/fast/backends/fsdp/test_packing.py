"""Packed (thd) micro-batches of the FSDP backend isolate their samples (regression: HF sdpa/eager
attention lets packed samples attend to each other unless a block-diagonal mask is passed).

Per-token log-probs of a packed micro-batch must equal those of each sample run alone through
the unmodified HF model (within fp32 rounding, ``tolerance.FP32_MODEL``), for sdpa and eager, Qwen2 and Llama; bshd (padded rows) too.
A negative control shows the same pack WITHOUT the block-diagonal mask differs, so the test can
fail. thd's two forms (padded grid, one row under the block mask) give the same log-probs and
gradients, with the plain and the fused head.
"""

from __future__ import annotations

import pytest
import torch

from rl_plugin.backends.fsdp import packing
from rl_plugin.backends.fsdp.model import install_fused_head, load_hf_model
from rl_plugin.backends.fsdp.packing import (
    micro_batch_log_probs,
    micro_batch_logits,
    model_inputs,
    packed_causal_mask,
    thd_as_padded_grid,
)
from rl_plugin.cp import build_response_layout
from rl_plugin.loss import ForwardOptions, MicroBatchInputs, log_probs_and_entropy
from tests.support.fsdp_common import alone_log_probs, make_step, rel_err, step_batch
from tests.support.tolerance import FP32_MODEL, tensor_within

CPU = torch.device("cpu")


def packed_log_probs(model, batch, impl, qkv_format="thd") -> torch.Tensor:
    fb = MicroBatchInputs.build(batch, qkv_format=qkv_format)
    rows = micro_batch_logits(model, fb, impl, CPU)
    logp, _ = log_probs_and_entropy(rows, fb.targets, with_entropy=False)
    return logp


@pytest.fixture(scope="module")
def torch_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_equals_each_sample_alone(tiny_checkpoint, torch_threads, family, impl):
    ckpt = tiny_checkpoint(family)
    model = load_hf_model(ckpt, attn_implementation=impl).eval()
    batch = step_batch(make_step(3))
    with torch.no_grad():
        want = alone_log_probs(model, batch)
        got_thd = packed_log_probs(model, batch, impl, "thd")
        got_bshd = packed_log_probs(model, batch, impl, "bshd")
    assert got_thd.shape == want.shape == (int(batch.response_lengths.sum()),)
    # fp32 forwards of the same weights in another shape: rounding only (a mask leak is > 1e-2)
    assert tensor_within(got_thd, want, rtol=FP32_MODEL), rel_err(got_thd, want)
    assert tensor_within(got_bshd, want, rtol=FP32_MODEL), rel_err(got_bshd, want)


def test_pack_without_block_mask_leaks_across_samples(tiny_checkpoint, torch_threads):
    """Negative control: a plain causal pass over the same pack (2-D all-ones mask, so HF builds
    one causal mask over the whole row) differs from the per-sample log-probs."""
    ckpt = tiny_checkpoint("qwen2")
    model = load_hf_model(ckpt, attn_implementation="sdpa").eval()
    batch = step_batch(make_step(3))
    fb = MicroBatchInputs.build(batch)
    kwargs, _ = model_inputs(fb, "sdpa", CPU, padded_grid=False)
    kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
    with torch.no_grad():
        want = alone_log_probs(model, batch)
        rows = model(**kwargs).logits.view(-1, 128)
        leaked, _ = log_probs_and_entropy(rows, fb.targets, with_entropy=False)
    assert rel_err(leaked, want) > 1e-2


def test_packed_causal_mask_structure():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    m = packed_causal_mask(cu, "sdpa")[0, 0]
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(m, want)
    e = packed_causal_mask(cu, "eager")[0, 0]
    assert e.dtype == torch.float32
    assert torch.equal(e == 0, want) and bool((e[~want] == torch.finfo(torch.float32).min).all())


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_padded_grid_equals_block_mask(tiny_checkpoint, torch_threads, monkeypatch, impl):
    """thd as a right-padded ``[S, L]`` grid with the 2-D padding mask vs one ``[1, t]`` row under
    the block-diagonal mask: log-probs and every parameter's gradient of ``sum(w * logp)``, plain
    head and fused head. Uneven lengths (3..16 tokens, a zero-length response). Both are the same
    fp32 model on the same tokens, each token seeing the same keys; only kernel summation order
    differs, on log-probs of magnitude ~5: ``tolerance.FP32_MODEL``."""
    ckpt = tiny_checkpoint("qwen2")
    batch = step_batch(make_step(5))
    mb = MicroBatchInputs.build(batch)
    assert thd_as_padded_grid(mb.layout, impl)  # the default form of this batch is the grid
    w = torch.randn(mb.layout.num_local_tokens, generator=torch.Generator().manual_seed(3))
    for fused in (False, True):
        out = {}
        for grid in (True, False):
            monkeypatch.setattr(packing, "thd_as_padded_grid", lambda layout, impl, grid=grid: grid)
            model = load_hf_model(ckpt, attn_implementation=impl)
            if fused:
                install_fused_head(model, fp32=False)
            logp, _ = micro_batch_log_probs(model, mb, ForwardOptions(1.0, 64, False), impl, CPU)
            (w * logp).sum().backward()
            out[grid] = (logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        (lp_grid, g_grid), (lp_row, g_row) = out[True], out[False]
        assert lp_grid.shape == (int(batch.response_lengths.sum()),)
        assert tensor_within(lp_grid, lp_row, rtol=FP32_MODEL), (fused, rel_err(lp_grid, lp_row))
        for name, grad in g_row.items():
            assert rel_err(g_grid[name], grad) < FP32_MODEL, (fused, name, rel_err(g_grid[name], grad))


def test_padded_grid_only_when_cheaper():
    """The grid costs S * L^2 attention scores, the row t^2: one dominating sample keeps the row;
    flash-attention keeps the row (varlen kernels, no mask)."""
    even = build_response_layout([9, 10, 8, 9], [4, 4, 3, 4])
    dominated = build_response_layout([100, 3, 3], [4, 2, 2])
    assert thd_as_padded_grid(even, "sdpa") and thd_as_padded_grid(even, "eager")
    assert not thd_as_padded_grid(dominated, "sdpa")
    assert not thd_as_padded_grid(even, "flash_attention_2")
    assert not thd_as_padded_grid(build_response_layout([9, 10], [4, 4], qkv_format="bshd"), "sdpa")
