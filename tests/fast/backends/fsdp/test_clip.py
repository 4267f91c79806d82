"""--clip-grad on the FSDP backend's sharded (DTensor) gradients, DP=2 on gloo.

With plain SGD (lr 1, no momentum) the weight update is minus the applied gradient, so:
- without clipping, the update's global norm equals the reported grad norm (the norm is taken
  over every DTensor shard of every rank, once);
- with --clip-grad c below that norm, the update is the unclipped one times
  c / (norm + 1e-6) (Megatron's and torch's coefficient), and the reported grad norm is the
  pre-clip norm;
- a non-finite gradient norm raises FloatingPointError on every rank and applies nothing.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.flags import exact_sgd
from tests.support.fsdp_common import fsdp_flags, make_step, parse, step_batch
from tests.support.tolerance import FP32_MODEL, within

CLIP = 1.0  # ~1/4 of the grad norm: the clipped update stays far above fp32 rounding of the weights


def worker(rank, world, ckpt):
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.loss.micro_batch_plan import split_samples_for_dp

    local = step_batch(make_step(5, with_ref=False)).select(split_samples_for_dp(9, world)[rank])
    out = {}
    for clip in (0.0, CLIP):
        backend = FSDPBackend.from_args(
            parse(fsdp_flags(ckpt, *exact_sgd(clip_grad=str(clip)), "--micro-batch-size", "2"))
        )
        w0 = backend.export_hf_state_dict()
        report = backend.train_step(local, num_groups=3)
        w1 = backend.export_hf_state_dict()
        w0_norm = math.sqrt(sum(float((w.double() ** 2).sum()) for w in w0.values()))
        out[clip] = dict(report=report, update={k: w1[k] - w0[k] for k in w0}, w0_norm=w0_norm)
    # A finite but absurd advantage (near fp32's max) overflows the gradient: its norm is inf.
    # (An absurd old log-prob no longer does: the log-ratio is clamped, as in verl and slime.)
    bad = step_batch(make_step(5, with_ref=False)).select(split_samples_for_dp(9, world)[rank])
    bad.advantages = torch.full_like(bad.advantages, 3e38)
    try:
        backend.train_step(bad, num_groups=3)
        out["nonfinite"] = None
    except FloatingPointError as err:
        w2 = backend.export_hf_state_dict()
        out["nonfinite"] = dict(message=str(err), unchanged=all(torch.equal(w2[k], w1[k]) for k in w1))
    return out


@pytest.fixture(scope="module")
def results(run_world, tiny_checkpoint):
    return run_world(worker, 2, tiny_checkpoint())


def test_clip_grad_on_dtensors(results):
    out = results[0]
    free, clipped = out[0.0], out[CLIP]
    norm = free["report"]["grad_norm"]
    assert norm > 2 * CLIP
    update_norm = math.sqrt(sum(float((u.double() ** 2).sum()) for u in free["update"].values()))
    # The update read back as w1 - w0 carries the fp32 rounding of w0 - lr * g (<= u * |w0| per
    # element), so it is compared against ||w0|| as well as the gradient's own norm.
    assert within(update_norm, norm, rtol=FP32_MODEL, scale=free["w0_norm"]), (update_norm, norm)
    assert clipped["report"]["grad_norm"] == norm  # the same code on the same gradient: the reported norm is pre-clip
    coeff = CLIP / (norm + 1e-6)
    diff = math.sqrt(
        sum(float(((clipped["update"][k] - u * coeff).double() ** 2).sum()) for k, u in free["update"].items())
    )
    assert within(diff, 0.0, rtol=FP32_MODEL, scale=update_norm * coeff + free["w0_norm"]), diff / (update_norm * coeff)


def test_nonfinite_gradient_raises_and_applies_nothing(results):
    for rank_out in results:
        bad = rank_out["nonfinite"]
        assert bad is not None, "a NaN gradient norm was applied"
        assert "non-finite gradient norm" in bad["message"] and "not applied" in bad["message"]
        assert bad["unchanged"]
