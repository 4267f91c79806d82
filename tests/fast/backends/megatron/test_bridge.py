"""mbridge conversion: HF -> megatron-core -> HF bit-exact (in memory and through ``--save-hf``),
logits equal the HF model, and the one-stage export equals mbridge's ``export_weights`` tensor by
tensor. The probes of the mbridge fixes are in ``compat/test_mbridge_fixes.py``.
"""

from __future__ import annotations

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
