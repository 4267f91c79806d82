"""Prompts with images: where each image goes (markers, chat parts, images first), the processor's
expanded ids, and the refusals (a count mismatch, a text-only checkpoint)."""

from __future__ import annotations

import pytest
from PIL import Image

from rl_plugin.models.tiny_vl import IMAGE_ID, VISION_END_ID, VISION_START_ID
from rl_plugin.rollout.data.tokenizer import PromptFormatError
from rl_plugin.rollout.data.vl_prompt import ImagePrompt, VLPrompts, rollout_prompts
from tests.support.tiny_vl import tiny_vl_dir, vl_rollout_config

RED, BLUE = Image.new("RGB", (56, 56), (255, 0, 0)), Image.new("RGB", (112, 56), (0, 0, 255))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_vl_dir(tmp_path_factory.mktemp("vl"))


def _decode(prompts, ids):
    return prompts.tok.decode(ids, skip_special_tokens=False)


def test_markers_place_the_images_and_the_processor_expands_them(ckpt):
    prompts = rollout_prompts(vl_rollout_config(apply_chat_template=True), ckpt)
    assert isinstance(prompts, VLPrompts)
    ids = prompts.image_prompt("A <image> then B <image>?", [RED, BLUE])
    assert isinstance(ids, ImagePrompt) and ids.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 8]]
    assert ids.pixel_values.shape == (16 + 32, 1176) and ids.images == [RED, BLUE]
    # 56x56 -> 2x2 merged tokens, 112x56 -> 4x2: the images' tokens in the marked places
    text = _decode(prompts, ids)
    pad, vs, ve = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"
    assert text == f"<|im_start|>user\nA {vs}{pad * 4}{ve} then B {vs}{pad * 8}{ve}?<|im_end|>\n<|im_start|>assistant\n"
    assert ids.count(IMAGE_ID) == 12 and ids.count(VISION_START_ID) == ids.count(VISION_END_ID) == 2


def test_no_marker_puts_the_images_first_with_and_without_a_template(ckpt):
    for chat in (True, False):
        prompts = rollout_prompts(vl_rollout_config(apply_chat_template=chat), ckpt)
        ids = prompts.image_prompt("What colour?", [RED])
        text = _decode(prompts, ids)
        want = "<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>What colour?"
        assert text.startswith("<|im_start|>user\n" + want) if chat else text == want, text


def test_chat_parts_are_the_places(ckpt):
    prompts = rollout_prompts(vl_rollout_config(apply_chat_template=True, system_prompt="Be brief."), ckpt)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"}]}]
    text = _decode(prompts, prompts.image_prompt(msgs, [RED]))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nLook: <|vision_start|>")


@pytest.mark.parametrize("prompt", ["<image><image>x", [{"role": "user", "content": [{"type": "image"}] * 2}]])
def test_a_place_count_other_than_the_images_is_refused(ckpt, prompt):
    prompts = rollout_prompts(vl_rollout_config(apply_chat_template=True), ckpt)
    with pytest.raises(PromptFormatError) as err:
        prompts.image_prompt(prompt, [RED])
    assert "marks 2 image places (<image> markers or image content parts) for 1 images" in err.value.rule


def test_a_text_only_checkpoint_is_refused_naming_the_flag(tiny_qwen2):
    tiny_checkpoint = tiny_qwen2
    with pytest.raises(ValueError) as err:
        rollout_prompts(vl_rollout_config(), tiny_checkpoint)
    assert f"--multimodal-keys with --hf-checkpoint {tiny_checkpoint}: that checkpoint is a text-only model" in str(
        err.value
    )
    assert "drop --multimodal-keys" in str(err.value)


def test_pixel_bounds_reach_the_processor(ckpt):
    prompts = rollout_prompts(vl_rollout_config(max_pixels=28 * 28 * 2, min_pixels=28 * 28), ckpt)
    assert prompts.image_prompt("x", [BLUE]).count(IMAGE_ID) == 2
