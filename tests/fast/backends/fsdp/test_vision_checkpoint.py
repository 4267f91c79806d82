"""Issue 46: a vision-language run's FSDP checkpoint holds the vision tower (slime #2194 saved only
the text weights) and resumes at the same or another data-parallel size with the same next step.

Two optimizer steps on the 6 VL samples of ``test_vision.vl_step`` (one image each; the advantages
flip sign between the steps, so step 2 moves every weight, vision tower included). A run saves after
step 1 at DP1 or DP2; fresh backends load it at DP1 and DP2 and take step 2: at the saving layout
the step is bitwise the uninterrupted one (loss, grad norm, every weight), at the other layout within
the fp32 reduction-order tolerance of ``test_checkpoint.test_dp2_checkpoint_loads_on_dp1``. The
checkpoint's own index names the ``model.visual.*`` tensors with their AdamW moments, and right
after the load, before step 2, every weight (vision tower included) equals the saved one bitwise.
"""

from __future__ import annotations

import pytest
import torch

from tests.fast.backends.fsdp.test_vision import hf_log_probs, vl_step
from tests.support import checkpointing
from tests.support.fsdp_common import fsdp_flags, parse
from tests.support.tiny_vl import tiny_vl_dir
from tests.support.tolerance import FP32_MODEL, tensor_within, within

FLAGS = ["--fsdp-attn-implementation", "eager", "--lr", "0.02", "--micro-batch-size", "2"]
SIGNS = {1: [1.0, -1.0] * 3, 2: [-1.0, 1.0] * 3}  # per sample (groups of 2); step 2 pushes back


def batch_of(step, k, rank, world):
    from rl_plugin.loss import StepBatch
    from rl_plugin.loss.micro_batch_plan import split_samples_for_dp

    adv = torch.repeat_interleave(torch.tensor(SIGNS[k]), step["response_lengths"])
    batch = StepBatch(**{**step, "advantages": adv}).validate()
    return batch.select(split_samples_for_dp(6, world)[rank])


def uninterrupted(rank, world, ckpt, step, root):
    from rl_plugin.backends.fsdp.backend import FSDPBackend

    backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, *FLAGS)))
    start = {k: v.clone() for k, v in backend.export_hf_state_dict().items()}
    backend.train_step(batch_of(step, 1, rank, world), num_groups=3)
    step1 = backend.export_hf_state_dict()
    checkpointing.save(backend, root, 1, extra={"rollout_id": 0})
    report = backend.train_step(batch_of(step, 2, rank, world), num_groups=3)
    return dict(start=start, step1=step1, report=report, weights=backend.export_hf_state_dict())


def resumed(rank, world, ckpt, step, root):
    from rl_plugin.backends.fsdp.backend import FSDPBackend

    backend = FSDPBackend.from_args(parse(fsdp_flags(ckpt, *FLAGS)))
    meta = checkpointing.load(backend, root)
    loaded = {k: v.clone() for k, v in backend.export_hf_state_dict().items()}
    report = backend.train_step(batch_of(step, 2, rank, world), num_groups=3)
    return dict(meta=meta, loaded=loaded, report=report, weights=backend.export_hf_state_dict())


@pytest.fixture(scope="module")
def runs(run_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_ckpt")
    ckpt = str(tiny_vl_dir(root))
    step = vl_step(ckpt)
    step["old_log_probs"] = hf_log_probs(ckpt, step).float().nan_to_num(-5.0)  # sample 4's tail: any value
    out = {"scale": float(step["old_log_probs"].abs().max())}  # |A| = 1
    for saved in (1, 2):
        save = str(root / f"save_dp{saved}")
        out[saved] = dict(save=save, first=run_world(uninterrupted, saved, ckpt, step, save)[0])
        for world in (1, 2):
            out[saved][world] = run_world(resumed, world, ckpt, step, save)[0]
    return out


def test_the_checkpoint_indexes_the_vision_tower_with_its_optimizer_state(runs):
    from torch.distributed.checkpoint import FileSystemReader

    from rl_plugin.checkpoint.layout import step_dir

    for saved in (1, 2):
        keys = list(FileSystemReader(step_dir(runs[saved]["save"], 1)).read_metadata().state_dict_metadata)
        vision = [k for k in keys if ".visual." in k]
        assert vision and any("exp_avg_sq" in k for k in vision), sorted(keys)[:20]
        assert any("language_model" in k for k in keys)


@pytest.mark.parametrize("saved", [1, 2])
def test_the_load_restores_every_weight_vision_tower_included(runs, saved):
    first = runs[saved]["first"]
    moved = [k for k in first["step1"] if not torch.equal(first["step1"][k], first["start"][k])]
    assert any(k.startswith("model.visual.") for k in moved)  # the saved step did train the tower
    for world in (1, 2):
        got = runs[saved][world]
        assert got["meta"] == {"step": 1, "extra": {"rollout_id": 0}}
        assert got["loaded"].keys() == first["step1"].keys()
        for name, w in first["step1"].items():
            assert torch.equal(got["loaded"][name], w), (saved, world, name)


@pytest.mark.parametrize("saved", [1, 2])
def test_the_next_step_at_the_saving_layout_is_bitwise(runs, saved):
    first, again = runs[saved]["first"], runs[saved][saved]
    assert again["report"] == first["report"]
    for name, w in first["weights"].items():
        assert torch.equal(again["weights"][name], w), name
    moved = [k for k in first["weights"] if not torch.equal(first["weights"][k], first["step1"][k])]
    assert any(k.startswith("model.visual.") for k in moved)


@pytest.mark.parametrize("saved, world", [(1, 2), (2, 1)])
def test_the_next_step_at_another_layout_is_within_fp32_reduction_order(runs, saved, world):
    a, b = runs[saved]["first"], runs[saved][world]
    assert within(b["report"]["loss"], a["report"]["loss"], rtol=FP32_MODEL, scale=runs["scale"])
    assert within(b["report"]["grad_norm"], a["report"]["grad_norm"], rtol=FP32_MODEL)
    assert b["report"]["lr"] == a["report"]["lr"]
    for name, w in a["weights"].items():
        assert tensor_within(b["weights"][name], w, rtol=FP32_MODEL), name
