"""Megatron's interleaved (virtual) pipeline schedule: PP2 x VPP2 trains exactly what PP1 trains.

``--num-layers-per-virtual-pipeline-stage 1`` on the tied 4-layer model of ``test_pipeline``: two
pipeline ranks of two model chunks of one layer each (rank 0 holds layers 0 and 2 and the
embedding, rank 1 layers 1 and 3, the final norm and the head), so every micro-batch crosses the
pipeline group three times forward and three times backward, and megatron-core runs
``forward_backward_pipelining_with_interleaving`` over the chunk list. The same worker as
``test_pipeline`` (same checkpointed start, the 4 aggregation modes x PPO clip / GSPO and the KL
loss against the reference model, whose chunks run the forward-only interleaved pass; plain SGD:
the update is the applied gradient): J, the grad norm and every updated weight equal PP1 within
``tolerance.FP32_MODEL``, the forward-only log-probs too.

The plan has 6 micro-batches (a multiple of P) for the cases, and the one-sample step has 1, which
the schedule pads to P = 2 with an idle micro-batch (megatron-core 0.16.1 needs M % P == 0):
the update must still be PP1's. The weight sync's stream (the fallback through rank 0) carries
every chunk's layers, bitwise equal to ``export_hf_state_dict``.
"""

from __future__ import annotations

import pytest
import torch

from tests.fast.parity.test_pipeline import CASES, _subset, compare, pipeline_worker
from tests.support.tolerance import FP32_MODEL, max_abs

VPP_CASES = CASES[:8] + [CASES[10]]  # every mode x {grpo, gspo}; the KL loss (the reference model's chunks)
VPP = ("--num-layers-per-virtual-pipeline-stage", "1")
VPP_KEY = ("sample_mean", "grpo")


@pytest.fixture(scope="module")
def tied_model(tiny_checkpoint):
    return str(tiny_checkpoint(tie_word_embeddings=True, num_layers=4))


@pytest.fixture(scope="module")
def runs(run_world, tied_model):
    pp1 = run_world(pipeline_worker, 1, 1, 1, tied_model, VPP_CASES)[0]
    vpp = run_world(pipeline_worker, 2, 2, 1, tied_model, VPP_CASES, True, VPP)
    return pp1, vpp


def test_pp2_vpp2_equals_pp1(runs):
    (want, logp1, scale, _), vpp = runs
    got, logp2, _, _ = vpp[0]
    assert torch.allclose(logp2, logp1, rtol=0, atol=FP32_MODEL * max(1.0, max_abs(logp1)))
    worst = compare(got, _subset(want, VPP_CASES), scale)
    # the interleaved schedule ran: the one-sample step's single micro-batch padded to P = 2
    assert want[("one_sample",)][0]["num_micro_batches"] == 1
    assert got[("one_sample",)][0]["num_micro_batches"] == 2
    assert got[VPP_KEY][0]["num_micro_batches"] == want[VPP_KEY][0]["num_micro_batches"] == 6
    print("\nPP2xVPP2 vs PP1 max |dJ|, |d grad norm|, max |d weight|:", *map(max, zip(*worst.values())))


def test_pp2_vpp2_weight_sync_stream(runs):
    """Each rank's two chunks stream through rank 0 bitwise (names, order, shapes, fingerprints:
    ``test_weight_export_stream._check_rank0``); rank 1 sends layers 1 and 3 (its chunks, in
    chunk order) and the tied copy of the embedding stays out."""
    from tests.fast.weight_sync.test_weight_export_stream import _check_rank0

    results = [r[3] for r in runs[1]]
    _check_rank0(results[0])
    names = results[0]["stream_names"]
    layers = [int(n.split(".")[2]) for n in names if ".layers." in n]
    assert list(dict.fromkeys(layers)) == [0, 2, 1, 3]
    assert names.count("model.embed_tokens.weight") == 1 and "lm_head.weight" not in names
    assert results[1]["streamed"] == 0 and results[1]["refused"] is None
