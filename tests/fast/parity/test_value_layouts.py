"""The Megatron value model (issue 47): the value step applies exactly dJ/dtheta on every layout.

One spawn per layout (TP1, TP2, DP2, PP2, PP2 x VPP2, TP2 with padded ``bshd`` rows) of a TIED 4-layer model (the value model unties the
embedding from the head: a missed untie would all-reduce the embedding's gradient with the head's
over the pipeline's embedding group). Inside it each ``--loss-aggregation`` mode runs from the
same checkpointed start with a seeded head (a fresh head is zeros), several micro-batches, the old
values = the start's forward-only values + seeded noise (some beyond ``--value-clip``, so both
branches of the clipped loss train) and seeded returns. With plain SGD (lr 1) the weight update
IS the applied gradient, so:

- ``value_loss``, ``grad_norm`` and every updated weight (HF names, ``score.weight`` included)
  agree across the layouts within ``tolerance.FP32_MODEL``;
- at TP1 they equal an independent reference: the exported start loaded by transformers'
  ``AutoModelForTokenClassification`` (num_labels=1), one sample at a time, the clipped loss
  written out here, the core's single-process ``aggregate``, autograd;
- a checkpoint written at TP2 after one step, loaded at TP1, PP2 and PP2 x VPP2, gives TP2's next step.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import replace

import pytest
import torch

from tests.support.flags import EXACT_SGD
from tests.support.tolerance import FP32_MODEL, within

VPP = ("--num-layers-per-virtual-pipeline-stage", "1")
BSHD = ("--qkv-format", "bshd", "--seq-length", "16")  # padded rows: the longest sample has 13 tokens
# name: (tp, pp, world, more layout flags)
LAYOUTS = {
    "tp1": (1, 1, 1, ()),
    "tp2": (2, 1, 2, ()),
    "dp2": (1, 1, 2, ()),
    "pp2": (1, 2, 2, ()),
    "vpp2": (1, 2, 2, VPP),
    "tp2_bshd": (2, 1, 2, BSHD),
}
MODES = [("sample_mean",), ("token_mean",), ("prompt_mean",), ("constant", "--loss-aggregation-divisor", "8")]
CLIP = 0.2
OLD_NOISE = 0.3  # |noise| > CLIP on about half the tokens: both branches of the max
RETURN_SCALE = 3.0


def _flags(tp, pp, layout, mode=MODES[1]):
    return [
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(pp),
        *layout,
        "--loss-aggregation",
        *mode,
        "--n-samples-per-prompt",
        "4",
        *EXACT_SGD,
    ]


def _global_batch():
    """The step's batch with seeded per-token noise (old values' offset) and returns, drawn for the
    GLOBAL batch so that every DP split sees the same numbers."""
    from tests.support.megatron_common import synthetic_batch

    batch, num_groups = synthetic_batch(seed=5, num_prompts=3, n_per_prompt=4)
    g = torch.Generator().manual_seed(7)
    n = batch.loss_mask.shape[0]
    noise = OLD_NOISE * torch.randn(n, generator=g)
    returns = RETURN_SCALE * torch.randn(n, generator=g)
    return replace(batch, values=noise, returns=returns), num_groups


def _with_old_values(local, values):
    return replace(local, values=values + local.values)  # local.values holds the noise


def _step(backend, local0, num_groups, split):
    """One value step from the current weights: (report, old values)."""
    old = backend.compute_values(local0)
    report = backend.value_train_step(
        _with_old_values(local0, old), num_groups=num_groups, micro_batches=split, value_clip=CLIP
    )
    return report, old


def layout_worker(rank, world, tp, pp, layout, hf_dir, ckpt_dir, role):
    """``role``: "save" (after the modes, one token_mean step, a checkpoint into ``ckpt_dir``, then
    the next step), "load" (the step from ``ckpt_dir``), "" (the modes only). Global rank 0
    returns ``{mode: (report, update)}``, the next step's ``(report, update)`` and, at one rank, the
    start exported for the HF reference; None elsewhere."""
    from rl_plugin.loss import LossConfig
    from rl_plugin.loss.micro_batch_plan import plan_micro_batches
    from tests.support.megatron_common import dp_shard, make_args
    from tests.support.megatron_value import seeded_head, value_backend

    backend = value_backend(hf_dir, *_flags(tp, pp, layout), world_size=world)
    ps = backend.parallel_state
    seeded_head(backend, seed=1, scale=0.5)
    batch, num_groups = _global_batch()
    local0 = dp_shard(batch, ps.dp_size, ps.dp_rank)
    split = plan_micro_batches(local0, micro_batch_size=1, max_tokens_per_gpu=24, dp_group=ps.dp_group)
    box = [tempfile.mkdtemp(prefix="mgt_value_") if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    w0 = backend.export_hf_state_dict()
    streamed = dict(backend.stream_hf_weights())  # the weight sync's path (pipelined: through rank 0)
    if rank == 0:
        assert sorted(streamed) == sorted(w0) and all(torch.equal(streamed[k], w0[k]) for k in w0)
        assert {k: tuple(t.shape) for k, t in backend.hf_weight_specs().items()} == {
            k: tuple(t.shape) for k, t in w0.items()
        }
    start = None
    if world == 1:
        start = f"{box[0]}_hf"
        backend.save_hf(start)
    backend.save_checkpoint(box[0], step=0)
    out, old0 = {}, None
    cfgs = {
        m[0]: LossConfig.from_args(make_args("--hf-checkpoint", hf_dir, *_flags(tp, pp, layout, m), world_size=world))
        for m in MODES
    }
    for mode in MODES:
        backend.load_checkpoint(box[0])
        backend.loss_config = cfgs[mode[0]]
        report, old = _step(backend, local0, num_groups, split)
        old0 = old if old0 is None else old0
        assert torch.equal(old, old0), "the forward-only values moved between reloads of the same checkpoint"
        w1 = backend.export_hf_state_dict()
        out[mode[0]] = (report, {k: w1[k] - w0[k] for k in w0})
    nxt = None
    backend.loss_config = cfgs["token_mean"]
    if role == "save":
        backend.load_checkpoint(box[0])
        _step(backend, local0, num_groups, split)
        backend.save_checkpoint(ckpt_dir, step=1)
    if role in ("save", "load"):
        backend.load_checkpoint(ckpt_dir)
        w1 = backend.export_hf_state_dict()
        report, _ = _step(backend, local0, num_groups, split)
        w2 = backend.export_hf_state_dict()
        nxt = (report, {k: w2[k] - w1[k] for k in w1})
    if rank:
        return None
    return out, nxt, start, old0


def _hf_reference(model_dir, mode, old_values):
    """(J, {hf name: update}) of the exported start, SGD lr 1 (module docstring)."""
    from transformers import AutoModelForTokenClassification

    from rl_plugin.loss import aggregate

    batch, _ = _global_batch()
    model = AutoModelForTokenClassification.from_pretrained(model_dir, dtype=torch.float32)
    vpreds, off = [], 0
    for t, r in zip(batch.total_lengths.tolist(), batch.response_lengths.tolist()):
        ids = batch.tokens[off : off + t]
        vpreds.append(model(ids[None]).logits[0, t - r - 1 : t - 1, 0])
        off += t
    v_new = torch.cat(vpreds)
    v_old = old_values + batch.values
    v_clip = v_old + (v_new - v_old).clamp(-CLIP, CLIP)
    per_token = 0.5 * torch.maximum((v_new - batch.returns) ** 2, (v_clip - batch.returns) ** 2)
    divisor = float(mode[2]) if len(mode) > 1 else None
    j = aggregate(
        per_token, batch.loss_mask, batch.response_lengths, mode[0], group_ids=batch.group_ids, divisor=divisor
    )
    j.backward()
    return float(j.detach()), {n: -p.grad.detach().clone() for n, p in model.named_parameters()}, v_new.detach()


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def _update_rel(da, db):
    assert sorted(da) == sorted(db), sorted(set(da) ^ set(db))
    num = math.sqrt(sum(float(((da[k] - db[k]) ** 2).sum()) for k in db))
    den = math.sqrt(sum(float((db[k] ** 2).sum()) for k in db))
    return num / den


@pytest.fixture(scope="module")
def tied_model(tiny_checkpoint):
    return str(tiny_checkpoint(tie_word_embeddings=True, num_layers=4))


@pytest.fixture(scope="module")
def results(run_world, tied_model, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("value_ckpt") / "iter_0000001")
    roles = {"tp2": "save", "tp1": "load", "pp2": "load", "vpp2": "load", "dp2": "", "tp2_bshd": ""}
    out = {}
    for name in ("tp2", "tp1", "pp2", "vpp2", "dp2", "tp2_bshd"):  # the saving layout first
        tp, pp, world, layout = LAYOUTS[name]
        out[name] = run_world(layout_worker, world, tp, pp, layout, tied_model, ckpt, roles[name])[0]
    return out


def test_value_step_agrees_across_layouts(results):
    base, _, _, _ = results["tp1"]
    scale = max(abs(float(r["value_loss"])) for r, _ in base.values())
    worst = {}
    for name, (out, _, _, _) in results.items():
        for mode, (report, upd) in out.items():
            ref_report, ref_upd = base[mode]
            errs = (_rel(report["value_loss"], ref_report["value_loss"]), _update_rel(upd, ref_upd))
            worst[name] = max(worst.get(name, 0.0), *errs)
            assert within(report["value_loss"], ref_report["value_loss"], rtol=FP32_MODEL, scale=scale), (name, mode)
            assert _rel(report["grad_norm"], ref_report["grad_norm"]) < FP32_MODEL, (name, mode)
            assert _update_rel(upd, ref_upd) < FP32_MODEL, (name, mode, _update_rel(upd, ref_upd))
            assert report["vf_clipfrac"] == pytest.approx(ref_report["vf_clipfrac"], abs=1e-6), (name, mode)
    print("\nlargest rel error (loss, update) vs TP1:", {k: f"{v:.2e}" for k, v in worst.items()})


def test_value_step_matches_hf_token_classification(results):
    out, _, start, old0 = results["tp1"]
    for mode in MODES:
        report, upd = out[mode[0]]
        j, upd_ref, v_new = _hf_reference(start, mode, old0)
        assert torch.allclose(v_new, old0, rtol=FP32_MODEL, atol=FP32_MODEL * float(v_new.abs().max()))
        assert within(report["value_loss"], j, rtol=FP32_MODEL, scale=abs(j)), (mode, report["value_loss"], j)
        assert _update_rel(upd, upd_ref) < FP32_MODEL, (mode, _update_rel(upd, upd_ref))
        assert "score.weight" in upd and float(upd["score.weight"].abs().max()) > 1e-3


def test_value_step_is_not_trivial(results):
    """The test can fail: the modes give different losses, the clip is active on some tokens and
    not all, the head's update is nonzero."""
    out, _, _, _ = results["tp1"]
    losses = [float(out[m[0]][0]["value_loss"]) for m in MODES]
    assert len({round(x, 6) for x in losses}) == len(losses), losses
    clipfrac = float(out["token_mean"][0]["vf_clipfrac"])
    assert 0.05 < clipfrac < 0.95, clipfrac


def test_checkpoint_relayout_gives_the_same_next_step(results):
    """TP2's checkpoint after one step, loaded at TP1, PP2 and PP2 x VPP2: the same next step as TP2's own."""
    _, (ref_report, ref_upd), _, _ = results["tp2"]
    for name in ("tp1", "pp2", "vpp2"):
        _, (report, upd), _, _ = results[name]
        assert _rel(report["value_loss"], ref_report["value_loss"]) < FP32_MODEL, name
        assert _rel(report["grad_norm"], ref_report["grad_norm"]) < FP32_MODEL, name
        assert _update_rel(upd, ref_upd) < FP32_MODEL, (name, _update_rel(upd, ref_upd))
    first, _, _, _ = results["tp2"]
    # the checkpoint holds the trained weights: the next step differs from the first one
    assert _rel(ref_report["value_loss"], first["token_mean"][0]["value_loss"]) > 1e-3
