"""A VL checkpoint's processor: loaded without torchvision, its pixel bounds, the image-token count."""

import pytest
from PIL import Image

from rl_plugin.models.tiny_vl import IMAGE_ID, MAX_PIXELS, MIN_PIXELS, make_tiny_vl_checkpoint
from rl_plugin.models.vl_processor import encode, image_token_count, is_vl_checkpoint, load_vl_processor


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_vl_checkpoint(tmp_path_factory.mktemp("vl") / "ck")


def test_pixel_bounds_of_the_processor_and_their_override(ckpt):
    proc = load_vl_processor(ckpt)
    big = Image.new("RGB", (448, 448))
    text = "<|vision_start|><|image_pad|><|vision_end|>x"
    assert encode(proc, text, [big])[0].count(IMAGE_ID) == MAX_PIXELS // 28**2  # 16: capped at max-pixels
    small = load_vl_processor(ckpt, max_pixels=MIN_PIXELS)
    assert encode(small, text, [big])[0].count(IMAGE_ID) == MIN_PIXELS // 28**2  # 4


@pytest.mark.parametrize("size", [(64, 64), (300, 90), (20, 500), (448, 448)])
def test_image_token_count_is_what_the_processor_makes(ckpt, size):
    proc = load_vl_processor(ckpt)
    ids, _, grid = encode(proc, "<|vision_start|><|image_pad|><|vision_end|>", [Image.new("RGB", size)])
    assert image_token_count(proc, *size) == ids.count(IMAGE_ID) == int(grid.prod()) // 4


def test_is_vl_checkpoint(ckpt, tmp_path):
    from rl_plugin.models.tiny import make_tiny_hf_checkpoint

    assert is_vl_checkpoint(ckpt)
    assert not is_vl_checkpoint(make_tiny_hf_checkpoint(tmp_path / "text"))
    assert not is_vl_checkpoint(tmp_path / "nothing")
