"""--clip-grad on the FSDP backend's sharded (DTensor) gradients, DP=2 on gloo.

With plain SGD (lr 1, no momentum) the weight update is minus the applied gradient, so:
- without clipping, the update's global norm equals the reported grad norm (the norm is taken
  over every DTensor shard of every rank, once);
- with --clip-grad c below that norm, the update is the unclipped one times
  c / (norm + 1e-6) (Megatron's and torch's coefficient), and the reported grad norm is the
  pre-clip norm.
"""

from __future__ import annotations

import math

from tests.fast.fsdp_common import fsdp_flags, make_step, parse, step_batch, tiny_checkpoint
from tests.fast.harness import run_world

SGD = ["--optimizer", "sgd", "--sgd-momentum", "0", "--lr", "1.0", "--micro-batch-size", "2"]
CLIP = 1.0  # ~1/4 of the grad norm: the clipped update stays far above fp32 rounding of the weights


def worker(rank, world, ckpt):
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.batching import split_samples_for_dp

    local = step_batch(make_step(5, with_ref=False)).select(split_samples_for_dp(9, world)[rank])
    out = {}
    for clip in (0.0, CLIP):
        backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, *SGD, "--clip-grad", str(clip))))
        w0 = backend.export_hf_state_dict()
        report = backend.train_step(local, num_groups=3)
        w1 = backend.export_hf_state_dict()
        out[clip] = dict(report=report, update={k: w1[k] - w0[k] for k in w0})
    return out


def test_clip_grad_on_dtensors(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory.getbasetemp())
    out = run_world(worker, 2, ckpt)[0]
    free, clipped = out[0.0], out[CLIP]
    norm = free["report"]["grad_norm"]
    assert norm > 2 * CLIP
    update_norm = math.sqrt(sum(float((u.double() ** 2).sum()) for u in free["update"].values()))
    assert math.isclose(update_norm, norm, rel_tol=1e-5), (update_norm, norm)
    assert math.isclose(clipped["report"]["grad_norm"], norm, rel_tol=1e-6)
    coeff = CLIP / (norm + 1e-6)
    diff = math.sqrt(sum(float(((clipped["update"][k] - u * coeff).double() ** 2).sum()) for k, u in free["update"].items()))
    assert diff / (update_norm * coeff) < 1e-5, diff / (update_norm * coeff)
