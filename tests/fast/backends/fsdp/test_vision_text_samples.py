"""A vision-language model's micro-batch whose samples carry no image (text-only records of a VL
run, the text baseline of ``benchmarks/vl_image_cost.py``) trains like any other: the vision tower
runs on the blank image placed nowhere (``backends/fsdp/vision.py``) and the log-probs equal a plain
HF forward of the text alone. It used to raise "0 image tokens in the prompts for 1 image
features": the blank image was given the micro-batch's (all-False) image mask."""

from __future__ import annotations

import pytest
import torch

from tests.support.fsdp_common import fsdp_flags, parse, rel_err
from tests.support.tiny_vl import tiny_vl_dir


def text_step() -> dict:
    g = torch.Generator().manual_seed(3)
    total, resp = torch.tensor([9, 7, 12, 6]), torch.tensor([3, 2, 4, 1])
    n = int(resp.sum())
    return dict(
        tokens=torch.randint(0, 256, (int(total.sum()),), generator=g),
        total_lengths=total,
        response_lengths=resp,
        loss_mask=torch.ones(n),
        advantages=torch.tensor([1.0, -1.0, 1.0, -1.0]).repeat_interleave(resp),
        group_ids=torch.arange(4) // 2,
    )


def worker(rank, world, ckpt, step):
    from rl_plugin.backends.fsdp.backend import FSDPBackend
    from rl_plugin.loss import StepBatch

    batch = StepBatch(**step).validate()
    backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, "--fsdp-attn-implementation", "eager")))
    log_probs = backend.compute_log_probs(batch).detach()
    report = backend.train_step(batch, num_groups=2)
    return log_probs, report


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(tiny_vl_dir(tmp_path_factory.mktemp("vl")))


def test_text_samples_of_a_vl_model_train_and_score_like_the_hf_forward(run_world, ckpt):
    from rl_plugin.backends.fsdp.model import load_hf_model

    step = text_step()
    log_probs, report = run_world(worker, 1, ckpt, step)[0]
    model = load_hf_model(ckpt, attn_implementation="eager").eval()
    want, start = [], 0
    for t, r in zip(step["total_lengths"].tolist(), step["response_lengths"].tolist()):
        ids = step["tokens"][start : start + t]
        start += t
        with torch.no_grad():
            rows = model(input_ids=ids.view(1, -1)).logits[0, t - r - 1 : t - 1].double().log_softmax(-1)
        want.append(rows.gather(1, ids[t - r :].view(-1, 1)).squeeze(1))
    assert rel_err(log_probs.double(), torch.cat(want)) < 2e-5
    assert report["grad_norm"] > 0 and torch.isfinite(torch.tensor(report["loss"]))
