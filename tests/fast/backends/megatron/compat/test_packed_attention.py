"""Packed (thd) attention of the local layer spec: the padded-batch form equals the block-mask form,
and the vectorised packed RoPE (``rope_thd``) is bitwise megatron-core's per-sample loop.

``VarlenDotProductAttention`` attends a packed stream either as one row under a block-diagonal
causal mask (``t^2`` scores) or, when cheaper, as a padded batch of its samples under the plain
causal mask (``S * L^2``). Both compute, for every real token, the same scores, softmax and
weighted sum of values; only the kernels' summation order differs, so outputs and gradients agree
to fp32 rounding (``FP32_MODEL``, scaled by the largest |value| / |output|).

The lean forms (one ``PackedGrid`` / ``RopeTables`` per packed layout, ``index_select`` pads,
dense RoPE tables) are checked bitwise, outputs and gradients, against the plain formulas they
replace: advanced-index pad + transpose + boolean unpad, and megatron-core's own RoPE.
"""

from __future__ import annotations

import pytest
import torch

from rl_plugin.cp import padded_attention_is_cheaper, segment_grid
from tests.support.tolerance import FP32_MODEL, max_abs, tensor_within


def test_segment_grid_pads_and_unpads_in_packed_order():
    cu = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    gather, valid = segment_grid(cu)
    assert gather.tolist() == [[0, 1, 2], [3, 0, 0], [4, 5, 0]]
    assert valid.tolist() == [[True, True, True], [True, False, False], [True, True, False]]
    x = torch.arange(6) * 10
    assert x[gather][valid].tolist() == x.tolist()


def test_padded_form_is_chosen_only_when_cheaper():
    assert padded_attention_is_cheaper(torch.tensor([0, 9, 18, 26]))  # 3 * 81 <= 26^2
    assert not padded_attention_is_cheaper(torch.tensor([0, 100, 101, 102, 103]))  # 4 * 100^2 > 103^2
    assert not padded_attention_is_cheaper(torch.tensor([0]))


def _worker(rank, world):
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from rl_plugin.backends.megatron.compat.cpu_shim import apply_cpu_shim
    from rl_plugin.backends.megatron.compat.local_attention import VarlenDotProductAttention

    apply_cpu_shim()
    mpu.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # the RNG state dropout forks (dropout is 0)
    heads, groups, dim = 4, 2, 8
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=heads * dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        use_cpu_initialization=True,
    )
    att = VarlenDotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)  # lengths 5, 1, 7, 3
    t = int(cu[-1])
    g = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.randn(t, n, dim, generator=g) for n in (heads, groups, groups))
    upstream = torch.randn(t, heads * dim, generator=g)
    results = {}
    for name in ("_dense_forward", "_padded_forward"):
        q, k, v = (x.clone().requires_grad_(True) for x in (q0, k0, v0))
        out = getattr(att, name)(q, k, v, cu, AttnMaskType.causal, None)
        (out * upstream).sum().backward()
        results[name] = [out.detach(), q.grad, k.grad, v.grad]
    # The plain padded form the lean one replaces: advanced-index pad, transpose copy, boolean unpad.
    gather, valid = segment_grid(cu)
    width = gather.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).triu(1).view(1, 1, width, width)
    q, k, v = (x.clone().requires_grad_(True) for x in (q0, k0, v0))
    padded = [x[gather].transpose(0, 1).contiguous() for x in (q, k, v)]
    out = super(VarlenDotProductAttention, att).forward(*padded, causal, attn_mask_type=AttnMaskType.causal)
    out = out.transpose(0, 1)[valid]
    (out * upstream).sum().backward()
    results["plain_padded"] = [out.detach(), q.grad, k.grad, v.grad]
    results["rope"] = _rope_pairs(mpu.get_context_parallel_group())
    mpu.destroy_model_parallel()
    return results


def _rope_pairs(cp_group):
    """(ours, megatron-core's) packed RoPE, for both layouts of the frequency table."""
    from megatron.core.models.common.embeddings import rope_utils

    from rl_plugin.backends.megatron.compat import rope_thd

    rope_thd.install()
    original = rope_thd._ORIGINAL["fn"]
    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, 8, generator=g)
    upstream = torch.randn(16, 4, 8, generator=g)
    pairs = []
    for rows in (7, 16):  # positions 0..max_s-1, or one row per packed position
        freqs = torch.randn(rows, 1, 1, 8, generator=g)
        # q (4 heads) and k (2 heads) share the tables; the second q call (same freqs, a new cu
        # tensor of equal values) reuses them: every call must still be bitwise megatron-core's.
        for heads, layout in ((4, cu), (2, cu), (4, cu.clone())):
            got = []
            for fn in (rope_utils._apply_rotary_pos_emb_thd, original):
                t = x[:, :heads].clone().requires_grad_(True)
                out = fn(t, layout, freqs, cp_group=cp_group)
                (out * upstream[:, :heads]).sum().backward()
                got.append((out.detach(), t.grad))
            pairs.append(got)
    return pairs


@pytest.fixture(scope="module")
def world_results(run_world):
    """One spawned gloo rank for both checks below (megatron-core's parallel state needs a group)."""
    return run_world(_worker, 1)[0]


def test_padded_attention_equals_block_mask_attention(world_results):
    res = world_results
    dense, padded = res["_dense_forward"], res["_padded_forward"]
    assert padded[0].shape == dense[0].shape == (16, 32)
    # Outputs are convex combinations of values: error ~ u * max|v|; gradients ~ u * their terms.
    for name, got, want in zip(("out", "dq", "dk", "dv"), padded, dense):
        assert tensor_within(got, want, rtol=FP32_MODEL, scale=max_abs(want)), name


def test_lean_padded_form_is_bitwise_the_plain_one(world_results):
    for name, got, want in zip(
        ("out", "dq", "dk", "dv"), world_results["_padded_forward"], world_results["plain_padded"]
    ):
        assert torch.equal(got, want), name


def test_vectorized_thd_rope_is_bitwise_megatrons(world_results):
    from rl_plugin.backends.megatron.compat.rope_thd import packed_freq_rows

    assert packed_freq_rows(torch.tensor([0, 2, 5]), 3).tolist() == [0, 1, 0, 1, 2]
    assert packed_freq_rows(torch.tensor([0, 2, 5]), 5).tolist() == [0, 1, 2, 3, 4]
    assert len(world_results["rope"]) == 6
    for (ours, d_ours), (theirs, d_theirs) in world_results["rope"]:
        assert ours.shape == theirs.shape and ours.shape[0] == 16
        assert torch.equal(ours, theirs) and torch.equal(d_ours, d_theirs)


def test_local_attention_refuses_thd_upstream():
    """``compat.local_attention`` is still needed: megatron-core's local attention refuses packed
    sequences (fails here => it takes them itself: delete ``VarlenDotProductAttention``)."""
    import inspect

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    assert "packed_seq_params is None" in inspect.getsource(DotProductAttention.forward)


def test_thd_rope_install_finds_megatrons_call_sites():
    """``compat.rope_thd.install`` skips a module without ``_apply_rotary_pos_emb_thd``: both of
    megatron-core's call sites must still have it (fails here => upstream renamed or vectorised it)."""
    import importlib

    from rl_plugin.backends.megatron.compat import rope_thd

    for name in rope_thd.MODULES:
        assert callable(getattr(importlib.import_module(name), "_apply_rotary_pos_emb_thd", None)), name
