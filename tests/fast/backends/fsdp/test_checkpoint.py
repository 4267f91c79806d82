"""FSDP checkpoints: save at step 1, load into a fresh backend, step 2 is identical.

DP=2 on gloo: model, AdamW moments, the LR schedule position, RNG and the step come back, so the
resumed step 2 equals the uninterrupted one bit for bit (loss, grad norm, lr, every weight), and
each rank's RNG stream continues where it was. The same checkpoint loads on DP=1 (DCP reshards)
and gives the same step 2 within fp32 reduction-order error (loaded from the step directory
itself, ``<save>/iter_0000001``). ``--save-hf`` writes a directory that
``AutoModelForCausalLM.from_pretrained`` loads with the trained weights. Saves go through the
loop's layout (``tests/support/checkpointing``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support import checkpointing
from tests.support.fsdp_common import fsdp_flags, make_step, parse, step_batch, tiny_checkpoint
from tests.support.tolerance import FP32_MODEL, tensor_within, within

SCHEDULE = ["--lr-decay-style", "linear", "--lr-decay-iters", "4", "--micro-batch-size", "2"]


def local_batch(seed, rank, world):
    from rl_plugin.loss.micro_batch_plan import split_samples_for_dp

    return step_batch(make_step(seed, with_ref=False)).select(split_samples_for_dp(9, world)[rank])


def uninterrupted(rank, world, ckpt, save_root, save_hf):
    from rl_plugin.backends.fsdp.backend import FSDPBackend

    backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, *SCHEDULE, "--save-hf", save_hf)))
    backend.train_step(local_batch(1, rank, world), num_groups=3)
    step1 = backend.export_hf_state_dict()
    checkpointing.save(backend, save_root, 1, extra={"rollout_id": 5})
    rng_after_save = torch.rand(4)
    report = backend.train_step(local_batch(2, rank, world), num_groups=3)
    return dict(step1=step1, rng=rng_after_save, report=report, weights=backend.export_hf_state_dict())


def resumed(rank, world, ckpt, save_root):
    from rl_plugin.backends.fsdp.backend import FSDPBackend

    torch.manual_seed(1000 + rank)  # a different stream: load must restore the saved one
    backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, *SCHEDULE)))
    meta = checkpointing.load(backend, save_root)
    rng = torch.rand(4)
    report = backend.train_step(local_batch(2, rank, world), num_groups=3)
    return dict(meta=meta, rng=rng, report=report, weights=backend.export_hf_state_dict())


@pytest.fixture(scope="module")
def runs(run_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_ckpt")
    ckpt = tiny_checkpoint(root, "qwen2")
    (Path(ckpt) / "tokenizer_config.json").write_text('{"marker": 1}')
    save_root, save_hf = str(root / "save"), str(root / "hf")
    first = run_world(uninterrupted, 2, ckpt, str(save_root), save_hf)
    again = run_world(resumed, 2, ckpt, str(save_root))
    dp1 = run_world(resumed, 1, ckpt, f"{save_root}/iter_0000001")
    return first, again, dp1, save_hf


def test_resume_continues_identically(runs):
    first, again, _, _ = runs
    for rank in range(2):
        a, b = first[rank], again[rank]
        assert b["meta"] == {"step": 1, "extra": {"rollout_id": 5}}
        assert torch.equal(a["rng"], b["rng"]), rank
        assert a["report"] == b["report"]
        assert a["report"]["lr"] == pytest.approx(0.75e-3)  # linear decay over 4 steps, at step 1
        for name, w in a["weights"].items():
            assert torch.equal(w, b["weights"][name]), name
        moved = max(float((a["weights"][n] - a["step1"][n]).abs().max()) for n in a["weights"])
        assert moved > 1e-4  # step 2 does change the weights


def test_dp2_checkpoint_loads_on_dp1(runs):
    first, _, dp1, _ = runs
    assert dp1[0]["meta"] == {"step": 1, "extra": {"rollout_id": 5}}
    a, b = first[0], dp1[0]
    # fp32 reduction order (DP=2 vs DP=1): J's per-token terms are -A * exp(logp - old), rounding
    # ~ |A| * u|logp|; the grad norm does not cancel (relative); the LR is the same arithmetic.
    step = make_step(2, with_ref=False)
    scale = float(step["advantages"].abs().max()) * float(step["old_log_probs"].abs().max())
    assert within(a["report"]["loss"], b["report"]["loss"], rtol=FP32_MODEL, scale=scale)
    assert within(a["report"]["grad_norm"], b["report"]["grad_norm"], rtol=FP32_MODEL)
    assert a["report"]["lr"] == b["report"]["lr"]
    # weights after AdamW: the update lr * m / (sqrt(v) + eps) moves by at most ~lr * FP32_MODEL for a
    # gradient error of FP32_MODEL * |g| (its derivative in g peaks at lr / (4 eps) where |g| = eps),
    # plus the rounding of w itself: both below FP32_MODEL * max|w| (lr 1e-3 << max|w|)
    for name, w in a["weights"].items():
        assert tensor_within(b["weights"][name], w, rtol=FP32_MODEL), name


def test_save_hf_directory_reloads(runs):
    from transformers import AutoModelForCausalLM

    first, _, _, save_hf = runs
    assert (Path(save_hf) / "tokenizer_config.json").read_text() == '{"marker": 1}'  # side files copied
    model = AutoModelForCausalLM.from_pretrained(save_hf, dtype=torch.float32)
    state = model.state_dict()
    for name, w in first[0]["step1"].items():
        assert torch.equal(state[name], w), name
