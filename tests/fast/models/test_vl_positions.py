"""``models.vl_positions``: the 3-D positions both backends give packed vision-language samples."""

from __future__ import annotations

import pytest
import torch

from tests.fast.backends.fsdp.test_vision import vl_step
from tests.support.tiny_vl import tiny_vl_dir


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(tiny_vl_dir(tmp_path_factory.mktemp("vl")))


def test_rope_index_of_the_config_equals_the_models(ckpt):
    """``RopeIndex(config)`` (Megatron: no HF model) gives the HF model's own rope index."""
    from rl_plugin.backends.fsdp.model import load_hf_model
    from rl_plugin.loss import StepBatch
    from rl_plugin.models.vl_positions import RopeIndex, packed_positions

    batch = StepBatch(**vl_step(ckpt)).validate()
    model = load_hf_model(ckpt, attn_implementation="eager")
    inner = next(m for m in model.modules() if hasattr(type(m), "get_rope_index"))
    want = packed_positions(inner, batch)
    got = packed_positions(RopeIndex(model.config), batch)
    assert torch.equal(got["positions"], want["positions"]) and torch.equal(got["image_mask"], want["image_mask"])


def test_the_response_continues_from_the_prompts_largest_position(ckpt):
    from transformers import AutoConfig

    from rl_plugin.loss import StepBatch
    from rl_plugin.models.tiny_vl import IMAGE_ID
    from rl_plugin.models.vl_positions import RopeIndex, packed_positions

    batch = StepBatch(**vl_step(ckpt)).validate()
    out = packed_positions(RopeIndex(AutoConfig.from_pretrained(ckpt)), batch)
    pos, mask = out["positions"], out["image_mask"]
    start = 0
    for i, (t, r) in enumerate(zip(batch.total_lengths.tolist(), batch.response_lengths.tolist())):
        prompt, response = pos[:, start : start + t - r], pos[:, start + t - r : start + t]
        top = int(prompt.max())
        assert response.tolist() == [list(range(top + 1, top + 1 + r))] * 3, i
        assert int(prompt[0].max()) < t - r  # the image's grid compresses its span: not 1 per token
        ids = batch.tokens[start : start + t]
        assert torch.equal(mask[start : start + t - r], ids[: t - r] == IMAGE_ID)
        assert not bool(mask[start + t - r : start + t].any())  # sample 4's sampled image token: not a place
        start += t
