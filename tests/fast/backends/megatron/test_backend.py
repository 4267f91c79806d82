"""Forward-only log-probs and the sequence layouts on the Megatron backend.

- packed ``thd`` and padded ``bshd`` give the same log-probs and the same step (grad norm);
- the reference model (``role="ref"``, for ``--use-kl-loss``) starts equal to the actor and stays
  frozen while the actor trains; a step with the KL term reports a positive ``kl_loss``.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace

import torch

from tests.support.flags import exact_sgd
from tests.support.tolerance import FP32_MODEL, within


def _worker(rank, world, hf_dir):
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import make_args, synthetic_batch

    backend = MegatronBackend.from_args(
        make_args(
            "--hf-checkpoint",
            hf_dir,
            *exact_sgd(lr="0.5"),
            "--micro-batch-size",
            "3",
        )
    )
    thd = backend.loss_config
    bshd = replace(thd, qkv_format="bshd")
    batch, groups = synthetic_batch(seed=13)
    ckpt = tempfile.mkdtemp(prefix="mgt_lp_")
    backend.save_checkpoint(ckpt, step=0)

    logp_thd = backend.compute_log_probs(batch)
    backend.loss_config = bshd
    logp_bshd = backend.compute_log_probs(batch)
    ref0 = backend.compute_log_probs(batch, role="ref")

    norms = {}
    for name, cfg in (("thd", thd), ("bshd", bshd)):
        backend.load_checkpoint(ckpt)
        backend.loss_config = cfg
        norms[name] = backend.train_step(batch, num_groups=groups)["grad_norm"]
    actor1 = backend.compute_log_probs(batch)
    ref1 = backend.compute_log_probs(batch, role="ref")
    backend.loss_config = replace(thd, use_kl_loss=True, kl_loss_coef=0.1)
    kl_report = backend.train_step(replace(batch, ref_log_probs=ref1), num_groups=groups)
    return {
        "layout_diff": float((logp_thd - logp_bshd).abs().max()),
        "ref_vs_actor0": float((ref0 - logp_thd).abs().max()),
        "norms": norms,
        "actor_moved": float((actor1 - logp_thd).abs().max()),
        "ref_frozen": bool(torch.equal(ref0, ref1)),
        "kl_loss": kl_report["kl_loss"],
        "finite": bool(torch.isfinite(logp_thd).all()) and bool((logp_thd <= 0).all()),
        "logp_scale": max(1.0, float(logp_thd.abs().max())),  # the magnitude fp32 log-prob rounding scales with
    }


def test_layouts_reference_model_and_kl(run_world, tiny_qwen2):
    out = run_world(_worker, 1, tiny_qwen2)[0]
    assert out["finite"]
    assert out["layout_diff"] < FP32_MODEL * out["logp_scale"], out  # thd vs padded bshd: fp32 rounding only
    assert out["ref_vs_actor0"] < FP32_MODEL * out["logp_scale"], out
    assert within(out["norms"]["bshd"], out["norms"]["thd"], rtol=FP32_MODEL), out
    assert out["actor_moved"] > 1e-3 and out["ref_frozen"], out
    assert out["kl_loss"] > 0, out
