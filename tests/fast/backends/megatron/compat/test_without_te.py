"""A GPU without transformer-engine (issue 37 item 7): which CPU-shim patches and config overrides
apply "without CUDA" and which "without transformer-engine" (``cpu_shim.needed``), and the upstream
behaviour that makes ``masked_softmax_fusion`` a "without transformer-engine" override: megatron-core's
fused causal softmax drops the mask it is given, so packed samples would see each other."""

from __future__ import annotations

import pytest
import torch

from rl_plugin.backends.megatron.compat import cpu_shim

CPU_ONLY = [
    "rng_tracker",
    "current_device",
    "cuda_device_literals",
    "tensor_type_names",
    "cuda_synchronize",
    "embedding_group_copy",
    "moe_dispatcher_stream",
]


def test_patches_per_machine():
    assert cpu_shim.patches_needed(cuda=False, te=False) == CPU_ONLY + ["router_gemm_name"]
    # a GPU without transformer-engine: the router's te_general_gemm NameError is not a CPU matter
    assert cpu_shim.patches_needed(cuda=True, te=False) == ["router_gemm_name"]
    assert cpu_shim.patches_needed(cuda=True, te=True) == []
    # a CPU with TE installed: TE runs on CUDA only, so the CPU needs everything
    assert cpu_shim.patches_needed(cuda=False, te=True) == CPU_ONLY + ["router_gemm_name"]
    with pytest.raises(ValueError, match="unknown condition"):
        cpu_shim.needed("sometimes", cuda=True, te=True)


def test_config_overrides_per_machine():
    cpu = cpu_shim.cpu_config_overrides(cuda=False, te=False)
    assert cpu == cpu_shim.CPU_CONFIG_OVERRIDES and cpu["masked_softmax_fusion"] is False
    assert cpu_shim.cpu_config_overrides(cuda=True, te=False) == {"masked_softmax_fusion": False}
    assert cpu_shim.cpu_config_overrides(cuda=True, te=True) == {}


def test_setup_passes_the_no_te_overrides_on_a_gpu(monkeypatch):
    """``setup.config_overrides`` on a CUDA machine without transformer-engine keeps the fused
    softmax off (mbridge turns it on)."""
    from rl_plugin.backends.megatron import setup
    from rl_plugin.configs import ModelConfig

    monkeypatch.setattr(setup, "transformer_engine_available", lambda: False)
    out = setup.config_overrides(ModelConfig(), cuda=True)
    assert out["masked_softmax_fusion"] is False and "bias_activation_fusion" not in out
    monkeypatch.setattr(setup, "transformer_engine_available", lambda: True)
    assert "masked_softmax_fusion" not in setup.config_overrides(ModelConfig(), cuda=True)


def test_fused_causal_softmax_ignores_the_packed_mask_upstream(monkeypatch):
    """megatron-core 0.16.1 ``FusedScaleMaskSoftmax``: with the fusion on, bf16 scores and a causal
    layer, the kernel it picks takes no mask (``forward_fused_softmax``); the block-diagonal mask
    of ``local_attention`` would be dropped. Fails here when upstream starts passing the mask (then
    ``masked_softmax_fusion`` may stay on without transformer-engine)."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    seen = []

    class Kernel:
        @staticmethod
        def apply(*args):
            seen.append(args)
            return args[0]

    monkeypatch.setattr(fused_softmax, "ScaledUpperTriangMaskedSoftmax", Kernel)
    # the kernel's block size comes from the compiled extension (a GPU build); any divisor will do
    monkeypatch.setattr(fused_softmax.FusedScaleMaskSoftmax, "get_batch_per_block", staticmethod(lambda *a: 4))
    softmax = fused_softmax.FusedScaleMaskSoftmax(
        input_in_fp16=False,
        input_in_bf16=True,
        attn_mask_type=AttnMaskType.causal,
        scaled_masked_softmax_fusion=True,
        mask_func=attention_mask_func,
        softmax_in_fp32=True,
        scale=None,
    )
    t = 32  # two packed samples of 16 tokens
    scores = torch.zeros(1, 4, t, t, dtype=torch.bfloat16)
    block = torch.ones(t, t, dtype=torch.bool)
    block[:16, :16] = block[16:, 16:] = False
    mask = (block | torch.ones(t, t, dtype=torch.bool).triu(1)).view(1, 1, t, t)  # True = masked
    softmax(scores, mask)
    assert len(seen) == 1 and all(not (torch.is_tensor(a) and a.dtype == torch.bool) for a in seen[0])
    # without the fusion the mask is applied: the second sample's first token sees itself only
    plain = fused_softmax.FusedScaleMaskSoftmax(
        False, True, AttnMaskType.causal, False, attention_mask_func, True, None
    )
    probs = plain(scores, mask)
    assert float(probs[0, 0, 16, 16]) == 1.0 and float(probs[0, 0, 16, :16].sum()) == 0.0
