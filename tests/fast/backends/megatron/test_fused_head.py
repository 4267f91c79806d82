"""Megatron backend, TP=2 (real gloo processes), tied embeddings, entropy bonus on: a step through
the fused head (final hidden rows + the output weight shard, the hidden gradient all-reduced by
the head, the weight gradient added into ``main_grad``) equals the step through the unfused path
(``--disable-fused-lm-head``: vocab-parallel logits, then log-probs). Old log-probs (forward-only
pass), J, the grad norm and every weight's SGD update agree; the tied weight's update includes
both its embedding-side and head-side gradients on both paths.

fp32 model: the paths differ only in the head's summation order, so ``tolerance.FP32_MODEL`` as
the whole-step parity tests: relative for log-probs, the grad norm and the updates; the loss terms
(-A * exp(logp - old), entropies ~ log V) against the magnitude of those terms, not their sum.
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch

from tests.support.flags import EXACT_SGD
from tests.support.tolerance import FP32_MODEL, within


def _worker(rank, world, hf_dir):
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import make_args, synthetic_batch, with_old_log_probs

    backend = MegatronBackend.from_args(
        make_args(
            "--hf-checkpoint",
            hf_dir,
            "--tensor-model-parallel-size",
            "2",
            *EXACT_SGD,
            "--entropy-coef",
            "0.3",
            "--rollout-temperature",
            "0.8",
            world_size=world,
        )
    )
    assert backend.fused_lm_head  # the default, where the model allows it
    obj = [tempfile.mkdtemp(prefix="mgt_fused_") if rank == 0 else None]
    torch.distributed.broadcast_object_list(obj, src=0)
    backend.save_checkpoint(obj[0], step=0)
    w0 = backend.export_hf_state_dict()
    batch, groups = synthetic_batch(seed=5, num_prompts=3, n_per_prompt=3, old_noise=0.2)
    out = {}
    for fused in (False, True):
        backend.load_checkpoint(obj[0])
        backend.fused_lm_head = fused
        old = backend.compute_log_probs(batch)
        report = backend.train_step(with_old_log_probs(batch, old), num_groups=groups)
        w1 = backend.export_hf_state_dict()
        out[fused] = (old, report, {k: w1[k] - w0[k] for k in w0})
    # magnitude of the loss terms: |A| * |logp| for the policy term, |logp| for the entropy term
    out["scale"] = float(batch.advantages.abs().max()) * max(1.0, float(old.abs().max()))
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def tied_dir(tiny_checkpoint):
    return tiny_checkpoint(tie_word_embeddings=True)


def test_tp2_fused_step_equals_unfused_step(run_world, tied_dir):
    out = run_world(_worker, 2, tied_dir)[0]
    (old_u, rep_u, upd_u), (old_f, rep_f, upd_f) = out[False], out[True]
    assert float((old_f - old_u).abs().max() / old_u.abs().max()) < FP32_MODEL
    for key in ("loss", "pg_loss", "entropy_loss"):
        assert within(rep_f[key], rep_u[key], rtol=FP32_MODEL, scale=out["scale"]), (key, rep_f[key], rep_u[key])
    assert within(rep_f["grad_norm"], rep_u["grad_norm"], rtol=FP32_MODEL)
    assert rep_u["entropy_loss"] > 0.1  # the entropy term (and its gradient) is in play
    num = math.sqrt(sum(float(((upd_f[k] - upd_u[k]) ** 2).sum()) for k in upd_u))
    den = math.sqrt(sum(float((upd_u[k] ** 2).sum()) for k in upd_u))
    assert den > 0 and num / den < FP32_MODEL, num / den
    emb = "model.embed_tokens.weight"
    assert float(upd_u[emb].abs().max()) > 0
    assert float((upd_f[emb] - upd_u[emb]).norm() / upd_u[emb].norm()) < FP32_MODEL
