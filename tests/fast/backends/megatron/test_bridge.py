"""mbridge conversion: HF -> megatron-core -> HF bit-exact (in memory and through ``--save-hf``),
logits equal the HF model, and the mbridge workarounds in ``bridge.py`` are still needed and
still work (3, the one-stage export, equals mbridge's ``export_weights`` tensor by tensor).

If a workaround test fails with "no longer needed", mbridge / transformers fixed it upstream:
delete the workaround from ``bridge.py`` and this test.
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.support.tolerance import FP32_MODEL


@pytest.fixture(scope="module")
def tiny_dirs(tiny_checkpoint, tiny_qwen2):
    return {
        "qwen2": tiny_qwen2,
        "llama": tiny_checkpoint("llama", seed=1),
        "qwen3": tiny_checkpoint("qwen3", seed=2),  # q/k norm, TP-replicated
    }


# -- workaround 1: rope_theta -----------------------------------------------------------------
def test_rope_theta_workaround_still_needed_and_works(tiny_dirs):
    from mbridge.core.llm_bridge import LLMBridge
    from transformers import AutoConfig

    from rl_plugin.backends.megatron.bridge import fix_rope_theta

    cfg = AutoConfig.from_pretrained(tiny_dirs["qwen2"])
    fake_bridge = types.SimpleNamespace(hf_config=cfg)
    with pytest.raises(AttributeError, match="rope_theta"):  # fails here => no longer needed
        LLMBridge._get_gptmodel_args(fake_bridge)
    assert fix_rope_theta(cfg) is True
    assert LLMBridge._get_gptmodel_args(fake_bridge)["rotary_base"] == 10000.0
    assert fix_rope_theta(cfg) is False  # idempotent


# -- workaround 2: local layer spec names ---------------------------------------------------------
LOCAL_NAMES = {
    "decoder.layers.1.input_layernorm.weight": ["model.layers.1.input_layernorm.weight"],
    "decoder.layers.1.pre_mlp_layernorm.weight": ["model.layers.1.post_attention_layernorm.weight"],
}


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_local_spec_names_workaround_still_needed_and_works(family):
    import mbridge  # noqa: F401
    from mbridge.core.bridge import _MODEL_REGISTRY

    from rl_plugin.backends.megatron.bridge import local_spec_bridge_class

    plain = _MODEL_REGISTRY[family]
    fixed = local_spec_bridge_class(plain)
    for name, hf_names in LOCAL_NAMES.items():
        with pytest.raises(NotImplementedError):  # fails here => mbridge maps local names itself
            plain._weight_name_mapping_mcore_to_hf(plain.__new__(plain), name)
        assert fixed._weight_name_mapping_mcore_to_hf(fixed.__new__(fixed), name) == hf_names
    # The subclass leaves mbridge's own class maps untouched.
    assert "pre_mlp_layernorm.weight" not in plain._MLP_MAPPING


# -- round trip and logits, in real processes --------------------------------------------------
def _roundtrip_worker(rank, world, tp, hf_dir, save_dir):
    from transformers import AutoModelForCausalLM

    from rl_plugin.backends.megatron.backend import MegatronBackend
    from rl_plugin.backends.megatron.forward import unwrap
    from tests.support.megatron_common import make_args, synthetic_batch

    backend = MegatronBackend.from_args(
        make_args("--hf-checkpoint", hf_dir, "--tensor-model-parallel-size", str(tp), world_size=world)
    )
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ref_sd = hf.state_dict()
    exported = backend.export_hf_state_dict()
    export_same = same_export(backend)
    same_keys = sorted(exported) == sorted(ref_sd)
    max_diff = max(float((exported[k] - ref_sd[k]).abs().max()) for k in ref_sd) if same_keys else float("inf")
    # Log-probs of a packed (thd) batch vs the HF model one sample at a time.
    batch, _ = synthetic_batch(seed=5, num_prompts=2, n_per_prompt=2)
    ours = backend.compute_log_probs(batch)
    ref, off = [], 0
    with torch.no_grad():
        for t, r in zip(batch.total_lengths.tolist(), batch.response_lengths.tolist()):
            ids = batch.tokens[off : off + t]
            z = hf(ids[None]).logits[0]
            ref.append(torch.log_softmax(z[t - r - 1 : t - 1], -1).gather(1, ids[t - r :, None]).squeeze(1))
            off += t
    # relative to the largest |log-prob| / |logit|: the magnitude their fp32 rounding scales with
    logp_diff = float((ours - torch.cat(ref)).abs().max()) / max(1.0, float(torch.cat(ref).abs().max()))
    logits_diff = None
    if tp == 1:  # raw logits, bshd rows and one packed thd row
        gpt = unwrap(backend.model)
        ids = batch.tokens[: int(batch.total_lengths[0])][None]
        with torch.no_grad():
            z_ref = hf(ids).logits
            z_bshd = gpt(ids, torch.arange(ids.shape[1])[None], None)
        logits_diff = float((z_bshd - z_ref).abs().max()) / float(z_ref.abs().max())
    # --save-hf: a directory transformers loads back, bit-exact.
    backend.save_hf(save_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(save_dir, dtype=torch.float32).state_dict()
    save_diff = max(float((reloaded[k] - ref_sd[k]).abs().max()) for k in ref_sd)
    return same_keys, max_diff, logp_diff, logits_diff, save_diff, export_same


def same_export(backend) -> bool:
    """Workaround 3: ``export_hf`` (one stage) and mbridge's ``export_weights`` give the same
    names in the same order and bitwise-equal tensors, on weights moved off the checkpoint's (so
    no two parameters coincide by construction)."""
    from rl_plugin.backends.megatron.bridge import export_hf

    g = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    params = list(backend.model.parameters())
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype))
    ours = [(n, t.clone()) for n, t in export_hf(backend.bridge, backend.model)]
    theirs = [(n, t.clone()) for n, t in backend.bridge.export_weights([backend.model])]
    same = [n for n, _ in ours] == [n for n, _ in theirs] and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for (_, a), (_, b) in zip(ours, theirs)
    )
    with torch.no_grad():  # back to the checkpoint's weights for the rest of the worker
        for p, v in zip(params, saved):
            p.copy_(v)
    return same


@pytest.mark.parametrize("family,tp", [("qwen2", 1), ("llama", 1), ("qwen2", 2), ("qwen3", 2)])
def test_hf_roundtrip_bit_exact_and_logits_match(run_world, tiny_dirs, family, tp, tmp_path):
    results = run_world(_roundtrip_worker, tp, tp, tiny_dirs[family], str(tmp_path / "saved_hf"))
    for same_keys, max_diff, logp_diff, logits_diff, save_diff, export_same in results:
        assert export_same, "export_hf (one stage) differs from mbridge's export_weights"
        assert save_diff == 0.0, f"--save-hf output differs: {save_diff}"
        assert same_keys
        assert max_diff == 0.0, f"round trip is not bit-exact: {max_diff}"
        assert logp_diff < FP32_MODEL, logp_diff  # two fp32 implementations of one model
        if logits_diff is not None:
            assert logits_diff < FP32_MODEL, logits_diff


# -- workaround 4: tied embeddings, one name map per bridge ----------------------------------------
def test_tied_map_workaround_still_needed_and_works(tiny_dirs, tmp_path):
    import mbridge  # noqa: F401
    from mbridge.core.bridge import _MODEL_REGISTRY
    from transformers import AutoConfig

    from rl_plugin.backends.megatron.bridge import tied_embeddings_bridge_class
    from rl_plugin.models.tiny import tiny_config

    tiny_config("qwen2", tie_word_embeddings=True).save_pretrained(tmp_path)
    tied, untied = AutoConfig.from_pretrained(tmp_path), AutoConfig.from_pretrained(tiny_dirs["qwen2"])
    plain = _MODEL_REGISTRY["qwen2"]
    saved = dict(plain._DIRECT_MAPPING)
    try:
        b = plain.__new__(plain)
        b.hf_config = tied
        b._adjust_mapping_for_shared_weights()
        # fails here => mbridge no longer writes a tied model's map into the class
        assert plain._DIRECT_MAPPING["output_layer.weight"] == "model.embed_tokens.weight"
    finally:
        plain._DIRECT_MAPPING.clear()
        plain._DIRECT_MAPPING.update(saved)
    for family in ("qwen2", "llama"):
        fixed = tied_embeddings_bridge_class(_MODEL_REGISTRY[family])
        maps = {}
        for label, cfg in (("tied", tied), ("untied", untied), ("tied again", tied)):
            b = fixed.__new__(fixed)
            b.hf_config = cfg
            b._adjust_mapping_for_shared_weights()
            maps[label] = (b._DIRECT_MAPPING["output_layer.weight"], b._get_hf_shared_weight_keys())
        assert maps["tied"] == maps["tied again"] == ("model.embed_tokens.weight", ["model.embed_tokens.weight"])
        assert maps["untied"] == ("lm_head.weight", [])
        assert _MODEL_REGISTRY[family]._DIRECT_MAPPING["output_layer.weight"] == "lm_head.weight"
