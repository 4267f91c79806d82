"""Megatron pipeline parallelism: PP = 2 trains exactly what PP = 1 trains.

One spawn per layout (PP1 on one rank, PP2 on two, PP2 x DP2 and PP2 x TP2 on four), on a tied
4-layer model; inside it every case (4 aggregation modes x PPO clip / GSPO, the unfused head, ``--fp32-lm-head``,
the KL loss against the reference model's forward-only pass, padded ``bshd`` rows)
runs from the same starting state (reloaded from a dist_checkpointing checkpoint, itself written
by that layout) on several micro-batches, so the 1F1B schedule really interleaves forward and
backward passes across the stages and exchanges differently shaped thd micro-batches. The old
log-probs come from the forward-only pass, which at PP = 2 runs through the same pipeline and is
broadcast from the last stage. With plain SGD (lr 1, no momentum, no clipping) the weight update
IS the applied gradient, so J, the grad norm and every updated weight must agree with PP = 1
within ``tolerance.FP32_MODEL`` (relative for the grad norm and the update; J against the
magnitude of its per-token terms, as in ``tests/fast/backends/megatron/test_parity.py``).

The tied model (``tie_word_embeddings``) puts the embedding on the first stage and its copy, the
output layer, on the last: the two gradients meet through megatron's embedding group
(``finalize_model_grads``), and a missed all-reduce changes the embedding's update by the whole
head gradient.
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch

from tests.support.flags import EXACT_SGD
from tests.support.tolerance import FP32_MODEL, max_abs, within

MODES = [("sample_mean",), ("token_mean",), ("prompt_mean",), ("constant", "--loss-aggregation-divisor", "8")]
CASES = [(m, p, ()) for m in MODES for p in ("grpo", "gspo")] + [
    (("token_mean",), "grpo", ("--disable-fused-lm-head",)),
    (("sample_mean",), "grpo", ("--fp32-lm-head",)),
    (("token_mean",), "grpo", ("--use-kl-loss", "--kl-loss-coef", "0.5", "--kl-loss-type", "k1")),
    (("sample_mean",), "gspo", ("--qkv-format", "bshd", "--seq-length", "16")),
]


def _case_flags(mode, policy, extra):
    return [
        "--loss-aggregation",
        *mode,
        "--advantage-estimator",
        policy,
        "--eps-clip",
        "0.2",
        "--n-samples-per-prompt",
        "4",
        "--rollout-temperature",
        "0.9",
        *extra,
    ]


def _key(case):
    mode, policy, extra = case
    return (mode[0], policy, *extra)


def pipeline_worker(rank, world, pp, tp, hf_dir, cases, export_check=False, layout=()):
    """Every case from the same checkpointed start: (report, {hf name: update}) per case, the
    forward-only log-probs of the start and J's scale, from global rank 0 (None elsewhere; every
    rank checks it holds the same log-probs); with ``export_check``, every rank's part of the
    weight sync's streamed export (``test_weight_export_stream._export_worker``) last. ``layout``:
    more layout flags (the interleaved schedule's, ``test_virtual_pipeline``)."""
    from dataclasses import replace

    from rl_plugin.backends.megatron.backend import MegatronBackend
    from rl_plugin.loss import LossConfig
    from rl_plugin.loss.micro_batch_plan import plan_micro_batches
    from tests.support.megatron_common import dp_shard, make_args, synthetic_batch, with_old_log_probs

    base = [
        "--hf-checkpoint",
        hf_dir,
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(pp),
        *layout,
        *EXACT_SGD,
    ]
    backend = MegatronBackend.from_args(make_args(*base, world_size=world))
    ps = backend.parallel_state
    batch, num_groups = synthetic_batch(seed=3, num_prompts=3, n_per_prompt=4, old_noise=0.3)
    local0 = dp_shard(batch, ps.dp_size, ps.dp_rank)
    w0 = backend.export_hf_state_dict()
    box = [tempfile.mkdtemp(prefix="mgt_pp_") if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    backend.save_checkpoint(box[0], step=0)
    logp0 = backend.compute_log_probs(local0)
    if ps.pp_size > 1:  # every stage of the replica holds the last stage's result
        gathered = [None] * ps.pp_size
        torch.distributed.all_gather_object(gathered, logp0, group=ps.pp_cpu_group)
        assert all(torch.equal(g, logp0) for g in gathered), "the forward-only log-probs differ between stages"
    # several micro-batches of different packed lengths: 1F1B with variable shapes
    split = plan_micro_batches(local0, micro_batch_size=1, max_tokens_per_gpu=24, dp_group=ps.dp_group)
    assert len(split) >= 6 // ps.dp_size, len(split)
    out = {}
    for case in cases:
        cfg = LossConfig.from_args(make_args(*base, *_case_flags(*case), world_size=world))
        backend.load_checkpoint(box[0])
        backend.loss_config = cfg
        local = with_old_log_probs(local0, backend.compute_log_probs(local0))
        if cfg.use_kl_loss:  # the frozen reference model, through the same pipeline
            local = replace(local, ref_log_probs=backend.compute_log_probs(local0, role="ref") + 0.1)
        report = backend.train_step(replace(local), num_groups=num_groups, micro_batches=split)
        w1 = backend.export_hf_state_dict()
        out[_key(case)] = (report, {k: w1[k] - w0[k] for k in w0})
    # one sample in the whole step: at DP2 the second replica has none and runs an idle micro-batch
    # through both stages (its loss x 0), so the update is the first replica's alone
    cfg = LossConfig.from_args(make_args(*base, *_case_flags(*CASES[0]), world_size=world))
    backend.load_checkpoint(box[0])
    backend.loss_config = cfg
    one = dp_shard(batch.select(torch.tensor([0])), ps.dp_size, ps.dp_rank)
    one = replace(one, old_log_probs=backend.compute_log_probs(one))  # ratio 1: nothing clipped
    report = backend.train_step(one, num_groups=1)
    w1 = backend.export_hf_state_dict()
    out[("one_sample",)] = (report, {k: w1[k] - w0[k] for k in w0})
    export = None
    if export_check:
        from tests.fast.weight_sync.test_weight_export_stream import _export_worker

        export = dict(_export_worker(backend, rank, world), pp_rank=ps.pp_rank, tp_rank=ps.tp_rank)
    if rank:
        return None, None, None, export
    return out, logp0, max_abs(local0.advantages) * max(1.0, max_abs(logp0)), export


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def _update_diff(da, db):
    """(relative L2 error of the update, max abs elementwise difference)."""
    num = math.sqrt(sum(float(((da[k] - db[k]) ** 2).sum()) for k in db))
    den = math.sqrt(sum(float((db[k] ** 2).sum()) for k in db))
    return num / den, max(float((da[k] - db[k]).abs().max()) for k in db)


def compare(got, want, scale):
    """Per case: |dJ|, rel grad-norm error, (rel, max abs) update error; asserts the tolerance."""
    assert set(got) == set(want)
    worst = {}
    for key, (report, upd) in want.items():
        r2, u2 = got[key]
        assert set(u2) == set(upd), key
        dj = abs(r2["loss"] - report["loss"])
        dg = _rel(r2["grad_norm"], report["grad_norm"])
        du, du_abs = _update_diff(u2, upd)
        worst[key] = (dj, abs(r2["grad_norm"] - report["grad_norm"]), du_abs)
        assert within(r2["loss"], report["loss"], rtol=FP32_MODEL, scale=scale), (key, r2["loss"], report["loss"])
        assert dg < FP32_MODEL and du < FP32_MODEL, (key, dg, du)
        for name in ("pg_clipfrac", "ppo_kl", "entropy"):
            if name in report:
                assert within(r2[name], report[name], rtol=FP32_MODEL, scale=1.0), (key, name)
    return worst


@pytest.fixture(scope="module")
def tied_model(tiny_checkpoint):
    return str(tiny_checkpoint(tie_word_embeddings=True, num_layers=4))


@pytest.fixture(scope="module")
def runs(run_world, tied_model):
    return {pp: run_world(pipeline_worker, pp, pp, 1, tied_model, CASES)[0] for pp in (1, 2)}


# four ranks: two cases and the one-sample step (the full set runs at PP2 x TP1 above)
FOUR_RANK_CASES = [CASES[3], CASES[8]]


def _subset(out, cases):
    keys = {_key(c) for c in cases} | {("one_sample",)}
    return {k: v for k, v in out.items() if k in keys}


@pytest.fixture(scope="module")
def four_ranks(run_world, tied_model):
    """PP2 x DP2 and PP2 x TP2 (every rank's answer); the latter also streams the weight export."""
    return {tp: run_world(pipeline_worker, 4, 2, tp, tied_model, FOUR_RANK_CASES, tp == 2) for tp in (1, 2)}


def test_pp2_equals_pp1(runs):
    (want, logp1, scale, _), (got, logp2, _, _) = runs[1], runs[2]
    assert torch.allclose(logp2, logp1, rtol=0, atol=FP32_MODEL * max(1.0, max_abs(logp1)))
    worst = compare(got, want, scale)
    print("\nPP2 vs PP1 max |dJ|, |d grad norm|, max |d weight|:", *map(max, zip(*worst.values())))


@pytest.mark.parametrize("tp", [1, 2], ids=["pp2_dp2", "pp2_tp2"])
def test_four_ranks_equal_pp1(runs, four_ranks, tp):
    """PP2 x DP2 (each stage's gradients all-reduced over DP; the one-sample step leaves the
    second replica an idle micro-batch) and PP2 x TP2 (vocab-parallel head on the last stage,
    both TP ranks of a stage exchanging activations with the other stage): J, grad norm and
    updates equal PP1's (TP2 = TP1 is ``backends/megatron/test_parity``'s)."""
    want, _, scale, _ = runs[1]
    got = four_ranks[tp][0][0]
    worst = compare(got, _subset(want, FOUR_RANK_CASES), scale)
    print(f"\n{tp=} four ranks vs PP1 max |dJ|, |d grad norm|, max |d weight|:", *map(max, zip(*worst.values())))


def test_cases_are_distinguishable(runs):
    """The comparison can fail: the cases give different J, the update is not small, and the
    embedding's update carries the head's gradient (tied: one tensor, both uses)."""
    want = runs[1][0]
    losses = [want[_key(c)][0]["loss"] for c in CASES[:8]]
    assert len({round(x, 7) for x in losses}) == len(losses), losses
    assert want[_key(CASES[0])][0]["grad_norm"] > 1e-3
    assert want[("one_sample",)][0]["grad_norm"] > 1e-3
    upd = want[_key(CASES[0])][1]
    assert "lm_head.weight" not in upd and float(upd["model.embed_tokens.weight"].abs().max()) > 0


def test_pp2_tp2_weight_sync_stream_reaches_rank0(four_ranks):
    """The weight sync's export at PP2 x TP2, tied: each stage's TP pair gathers its own layers;
    the last stage's TP rank 0 sends its HF tensors to global rank 0 (the fallback through rank 0,
    ``backends/megatron/pipeline_export.py``), which streams the whole export in spec order, bit
    for bit with ``export_hf_state_dict``, the tied copy on the last stage left out, and publishes
    it (fingerprint equal, an engine reads it exactly); no other rank gets a tensor."""
    from tests.fast.weight_sync.test_weight_export_stream import _check_rank0

    results = [r[3] for r in four_ranks[2]]
    _check_rank0(results[0])
    assert [(r["pp_rank"], r["tp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    names = results[0]["stream_names"]
    assert names.count("model.embed_tokens.weight") == 1 and "lm_head.weight" not in names
    assert [n for n in names if ".layers." in n][-1].startswith("model.layers.3.")  # the last stage's layers
    assert results[0]["gathers"] == results[1]["gathers"] > 0  # stage 0's TP pair
    assert results[2]["gathers"] == results[3]["gathers"] > 0  # stage 1's TP pair
    assert [r["streamed"] for r in results[1:]] == [0, 0, 0]
    assert [r["refused"] for r in results[1:]] == [None, None, None]
