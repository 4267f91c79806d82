"""Expert parallelism changes where experts live, not the step: at DP = 2, EP = 2 gives EP = 1's
J, router-loss metrics and gradient (exact SGD at lr 1: the weight update IS the applied gradient),
with and without the aux losses (``--moe-aux-loss-coeff``, ``--moe-z-loss-coeff``), on the tiny
Qwen3-MoE.

The 9 samples split 5 / 4 over DP and ``--micro-batch-size 2`` gives the ranks 3 and 2
micro-batches: at EP = 2 the second rank runs one idle pass (``backends/megatron/step.py``),
which must add exactly nothing, to the gradient or to the logged router losses. The aux losses
must change the update (else the test would not see them).

The FSDP backend (the HF model's own MoE layer, DP = 2, the router losses from its router's logits)
trains the same step as Megatron at EP = 2, with and without the router losses.

Tolerance: ``tolerance.FP32_MODEL`` (the all-to-all reorders the experts' inputs, so sums round
differently), relative for the update (l2 over all weights) and J against the magnitude of its
terms max|A| * max(1, max|logp|), as ``tests/fast/backends/megatron/test_parity.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.flags import EXACT_SGD
from tests.support.tolerance import FP32_MODEL, max_abs, within

AUX = ("--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001")


def _worker(rank, world, ep, hf_dir):
    from rl_plugin.backends.megatron.backend import MegatronBackend
    from tests.support.megatron_common import dp_shard, make_args, synthetic_batch, with_old_log_probs

    common = ["--hf-checkpoint", hf_dir, "--micro-batch-size", "2", *EXACT_SGD]
    base = [*common, "--expert-model-parallel-size", str(ep)]
    batch, num_groups = synthetic_batch(seed=3, num_prompts=3, n_per_prompt=3, old_noise=0.3)
    out = {}
    fsdp = [("fsdp", ("--train-backend", "fsdp")), ("fsdp_aux", ("--train-backend", "fsdp", *AUX))]
    runs = [("plain", ()), ("aux", AUX)] + (fsdp if ep == 2 else [])
    for label, extra in runs:
        if label.startswith("fsdp"):
            from rl_plugin.backends.fsdp.backend import FSDPBackend

            backend = FSDPBackend.from_args(make_args(*common, *extra, world_size=world))
        else:
            backend = MegatronBackend.from_args(make_args(*base, *extra, world_size=world))
        ps = backend.parallel_state
        # the weight sync's contract: the stream yields what the specs announce, in their order
        specs, streamed = backend.hf_weight_specs(), list(backend.stream_hf_weights())
        if rank == 0:
            assert [n for n, _ in streamed] == list(specs), label
            assert all(t.shape == specs[n].shape for n, t in streamed), label
        local = dp_shard(batch, ps.dp_size, ps.dp_rank)
        w0 = backend.export_hf_state_dict()
        if rank == 0:  # HF -> megatron-core (EP = 2: half the experts per rank) -> HF, bit-exact
            from safetensors.torch import load_file

            disk = load_file(f"{hf_dir}/model.safetensors")
            assert sorted(w0) == sorted(disk) and all(torch.equal(w0[k], disk[k]) for k in disk), label
        logp = backend.compute_log_probs(local)
        report = backend.train_step(with_old_log_probs(local, logp), num_groups=num_groups)
        w1 = backend.export_hf_state_dict()
        scale = max_abs(local.advantages) * max(1.0, max_abs(logp))
        out[label] = (report, {k: w1[k] - w0[k] for k in w0}, scale)
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def results(run_world, tmp_path_factory):
    from rl_plugin.models.tiny import make_tiny_moe_checkpoint

    hf_dir = str(make_tiny_moe_checkpoint(tmp_path_factory.mktemp("ep") / "qwen3_moe", "qwen3_moe", seed=7))
    return {ep: run_world(_worker, 2, ep, hf_dir)[0] for ep in (1, 2)}


def _update_rel(da, db) -> float:
    num = math.sqrt(sum(float(((da[k] - db[k]) ** 2).sum()) for k in db))
    return num / math.sqrt(sum(float((db[k] ** 2).sum()) for k in db))


def _max_abs_diff(da, db) -> float:
    return max(float((da[k] - db[k]).abs().max()) for k in db)


@pytest.mark.parametrize("label", ["plain", "aux"])
def test_ep2_equals_ep1(results, label):
    (r1, d1, scale), (r2, d2, _) = results[1][label], results[2][label]
    assert sorted(d1) == sorted(d2)
    assert within(r2["loss"], r1["loss"], rtol=FP32_MODEL, scale=scale), (r2["loss"], r1["loss"])
    assert within(r2["grad_norm"], r1["grad_norm"], rtol=FP32_MODEL), (r2["grad_norm"], r1["grad_norm"])
    rel = _update_rel(d2, d1)
    print(
        f"EP parity ({label}): J {r1['loss']:.9g} vs {r2['loss']:.9g}, update max|diff| {_max_abs_diff(d2, d1):.3g}, rel l2 {rel:.3g}"
    )
    assert rel < FP32_MODEL, rel
    if label == "aux":
        for name in ("moe_load_balancing_loss", "moe_z_loss"):
            assert r1[name] > 0 and math.isfinite(r1[name]), (name, r1[name])
            assert within(r2[name], r1[name], rtol=FP32_MODEL), (name, r2[name], r1[name])
    else:
        assert not any(k.startswith("moe_") for k in r1)


@pytest.mark.parametrize("label", ["plain", "aux"])
def test_fsdp_equals_megatron_ep2(results, label):
    """The FSDP backend on the HF MoE model (fused experts, exported one tensor per expert; its
    router losses from the HF router's logits, ``backends/fsdp/router_losses.py``) trains the step
    Megatron trains at EP = 2: same names, J, grad norm, router losses and update."""
    (rm, dm, scale), (rf, df, _) = results[2][label], results[2]["fsdp" if label == "plain" else "fsdp_aux"]
    assert sorted(dm) == sorted(df)
    assert within(rf["loss"], rm["loss"], rtol=FP32_MODEL, scale=scale), (rf["loss"], rm["loss"])
    assert within(rf["grad_norm"], rm["grad_norm"], rtol=FP32_MODEL), (rf["grad_norm"], rm["grad_norm"])
    rel = _update_rel(df, dm)
    print(f"Megatron EP=2 vs FSDP ({label}): update max|diff| {_max_abs_diff(df, dm):.3g}, rel l2 {rel:.3g}")
    assert rel < FP32_MODEL, rel
    names = [k for k in rm if k.startswith("moe_")]
    assert names == [k for k in rf if k.startswith("moe_")] and (label == "plain") == (not names)
    for name in names:
        assert within(rf[name], rm[name], rtol=FP32_MODEL), (name, rf[name], rm[name])


def test_aux_losses_change_the_update(results):
    plain, aux = results[1]["plain"][1], results[1]["aux"][1]
    assert _update_rel(aux, plain) > 1e3 * FP32_MODEL
