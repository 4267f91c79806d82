"""The tiny Qwen2.5-VL checkpoint: built locally, loaded by transformers' auto classes, runs image + text."""

import hashlib

import pytest
import torch
from PIL import Image

from rl_plugin.models.tiny_vl import IMAGE_ID, main, make_tiny_vl_checkpoint
from rl_plugin.models.vl_processor import encode, load_vl_processor

PROMPT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_vl_checkpoint(tmp_path_factory.mktemp("vl") / "ck")


def test_auto_classes_load_it_and_a_forward_on_image_and_text_runs(ckpt):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert model.config.text_config.hidden_size // model.config.text_config.num_attention_heads >= 32
    proc = load_vl_processor(ckpt)
    text = proc.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What colour?<|im_end|>")
    ids, pixels, grid = encode(proc, text, [Image.new("RGB", (64, 64), (255, 0, 0))])
    # 64x64 resizes to 56x56 (the min-pixels bound): a 4x4 patch grid, 2x2 merged -> 4 image tokens
    assert grid.tolist() == [[1, 4, 4]] and pixels.shape == (16, 3 * 2 * 14 * 14)
    assert ids.count(IMAGE_ID) == 4
    logits = model(input_ids=torch.tensor([ids]), pixel_values=pixels, image_grid_thw=grid).logits
    assert logits.shape == (1, len(ids), model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()
    # the image reaches the logits: another colour, other logits at the last position
    _, blue, _ = encode(proc, text, [Image.new("RGB", (64, 64), (0, 0, 255))])
    other = model(input_ids=torch.tensor([ids]), pixel_values=blue, image_grid_thw=grid).logits
    assert (other[0, -1] - logits[0, -1]).abs().max() > 1e-3


def test_same_seed_same_bytes_and_the_command_line(tmp_path, capsys):
    assert main([str(tmp_path / "a")]) == 0
    assert str(tmp_path / "a") in capsys.readouterr().out
    make_tiny_vl_checkpoint(tmp_path / "b")
    digest = [hashlib.sha256((tmp_path / d / "model.safetensors").read_bytes()).hexdigest() for d in "ab"]
    assert digest[0] == digest[1]
    assert main([]) == 2
