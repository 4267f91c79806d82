"""Checkpoints of the interleaved (virtual) pipeline schedule reshard: PP2 x VPP2 <-> PP1.

Under ``--num-layers-per-virtual-pipeline-stage 1`` each of the two pipeline ranks holds two
model chunks (layers 0, 2 and 1, 3 of the tied 4-layer model); each chunk saves its layers under
their global numbers (``checkpoint._model_sharded_state_dict``: ``model0`` / ``model1``, as
Megatron-LM nests them), with the distributed optimizer's state in model space. The same
protocol as ``test_reshard_pipeline`` (whose worker runs here):

    PP2 x VPP2: step 1, save A, steps 2, 3   -> the uninterrupted numbers
    PP1:        load A, save B, steps 2, 3   -> = PP2 x VPP2
    PP2 x VPP2: load B, steps 2, 3           -> = PP1 (and back)

loaded weights bitwise, the LR bitwise, loss and grad norm (step 3: the restored Adam state)
within ``FP32_MODEL``.
"""

from __future__ import annotations

import pytest

from tests.fast.backends.megatron.test_reshard_pipeline import _assert_continues, reshard_worker

VPP = ("--num-layers-per-virtual-pipeline-stage", "1")


@pytest.fixture(scope="module")
def runs(run_world, tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("mgt_reshard_vpp")
    hf_dir = str(tiny_checkpoint(tie_word_embeddings=True, num_layers=4))
    a, b = str(root / "A"), str(root / "B")
    vpp = run_world(reshard_worker, 2, 2, 1, hf_dir, None, a, VPP)[0]
    pp1 = run_world(reshard_worker, 1, 1, 1, hf_dir, a, b)[0]
    back = run_world(reshard_worker, 2, 2, 1, hf_dir, b, None, VPP)[0]
    return vpp, pp1, back


def test_vpp_checkpoint_resumes_at_pp1(runs):
    vpp, pp1, _ = runs
    _assert_continues(pp1, vpp)


def test_pp1_checkpoint_resumes_at_vpp(runs):
    _, pp1, back = runs
    _assert_continues(back, pp1)
    assert back["reports"][0]["grad_norm"] != back["reports"][1]["grad_norm"]  # the weights moved
