"""SFT conversations with images (``rl_plugin.rollout.data.vl_sft``): the ids, pixel values and grids
are the processor's own for the whole conversation, the loss mask is 1 on the assistant's tokens
and their ``<|im_end|>`` only (0 on every image token), the batch carries the images in
``loss.batch``'s layout, and a conversation whose image comes after its first answer is refused."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from rl_plugin.rollout.data.dataset import PromptRecord
from tests.support.tiny_vl import tiny_vl_dir, vl_rollout_config


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    from rl_plugin.rollout.data.vl_prompt import rollout_prompts

    ckpt = tiny_vl_dir(tmp_path_factory.mktemp("vl"))
    return rollout_prompts(vl_rollout_config(apply_chat_template=True), ckpt)


def _image(path, size, rgb) -> str:
    Image.new("RGB", size, rgb).save(path)
    return str(path)


def _record(prompt, label, images, index=0) -> PromptRecord:
    return PromptRecord(prompt, label, index, index + 1, {}, f"train.jsonl:{index + 1}", images)


def test_ids_pixels_and_grid_are_the_processors_and_only_the_answer_trains(prompts, tmp_path):
    from rl_plugin.models.vl_processor import encode
    from rl_plugin.rollout.data.vl_sft import sft_example as example_of

    a, b = _image(tmp_path / "a.png", (56, 84), (200, 10, 10)), _image(tmp_path / "b.png", (112, 56), (5, 5, 250))
    chat = [
        {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"}, {"type": "image"}]},
        {"role": "assistant", "content": "red, blue"},
        {"role": "user", "content": "And?"},
        {"role": "assistant", "content": "done"},
    ]
    ex = example_of(prompts, _record(chat, None, [a, b]))
    proc = prompts.processor
    text = proc.apply_chat_template(prompts.image_messages(chat), tokenize=False)
    ids, pixels, grid = encode(proc, text, [Image.open(a).convert("RGB"), Image.open(b).convert("RGB")])
    assert ex.ids == ids and torch.equal(ex.pixel_values, pixels) and torch.equal(ex.image_grid_thw, grid)
    image = torch.tensor(ex.ids) == proc.image_token_id
    assert int(image.sum()) == int(grid.prod(-1).sum()) // 4 == 6 + 8
    mask = torch.tensor(ex.mask)
    assert not bool(mask[image].any())
    trained = proc.tokenizer.decode([t for t, m in zip(ex.ids, ex.mask) if m])
    assert trained == "red, blue<|im_end|>done<|im_end|>"


def test_a_prompt_string_without_marker_puts_its_image_first(prompts, tmp_path):
    from rl_plugin.rollout.data.sft import sft_tensors
    from rl_plugin.rollout.data.vl_sft import sft_example as example_of

    a = _image(tmp_path / "a.png", (56, 56), (10, 200, 10))
    ex = example_of(prompts, _record("Which colour?", "green", [a]))
    marked = example_of(prompts, _record("<image>Which colour?", "green", [a]))
    assert ex.ids == marked.ids and ex.ids[ex.prompt_length - 1] != prompts.processor.image_token_id
    text = prompts.processor.tokenizer.decode(ex.ids)
    assert "user\n<|vision_start|><|image_pad|>" in text and text.endswith("assistant\ngreen<|im_end|>\n")
    plain = example_of(prompts, _record("<image>Which colour?", "blue", [a], index=1))
    t = sft_tensors([ex, plain])
    assert t["image_counts"].tolist() == [1, 1] and t["image_grid_thw"].tolist() == [[1, 4, 4]] * 2
    assert torch.equal(t["pixel_values"], torch.cat([ex.pixel_values, plain.pixel_values]))
    assert t["response_lengths"].tolist() == [len("green") + 2, len("blue") + 2]  # answer, <|im_end|>, "\n"


@pytest.mark.parametrize(
    "chat, images, message",
    [
        (
            [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "<image>What?"},
                {"role": "assistant", "content": "red"},
            ],
            1,
            "image tokens come after the first assistant turn",
        ),
        (
            [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "red"}],
            2,
            "marks 1 image places (<image> markers or image content parts) for 2 images",
        ),
    ],
    ids=["image-after-the-first-answer", "places-and-images-differ"],
)
def test_refused_naming_the_record(prompts, tmp_path, chat, images, message):
    from rl_plugin.rollout.data.vl_sft import sft_example as example_of

    refs = [_image(tmp_path / f"{i}.png", (56, 56), (9, 9, 9)) for i in range(images)]
    with pytest.raises(ValueError) as err:
        example_of(prompts, _record(chat, None, refs, index=4))
    assert "train.jsonl:5" in str(err.value) and message in str(err.value) and "Fix:" in str(err.value)


def test_the_trainer_refuses_a_bad_record_before_ray(prompts, tmp_path, capsys):
    """The preflight (``check_sft_file`` with the image key) templates every record with its images:
    a conversation whose image comes after its first answer is refused naming its line."""
    import json

    from rl_plugin.train import main

    _image(tmp_path / "a.png", (56, 56), (200, 10, 10))
    late = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "<image>What colour?"},
        {"role": "assistant", "content": "red"},
    ]
    rows = [
        {"prompt": "<image>What colour?", "label": "red", "images": ["a.png"]},
        {"prompt": late, "images": ["a.png"]},
    ]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ckpt = prompts.processor.tokenizer.name_or_path
    argv = ["--train-backend", "fsdp", "--hf-checkpoint", ckpt, "--prompt-data", str(data), "--loss-type", "sft_loss"]
    argv += ["--multimodal-keys", '{"image": "images"}', "--apply-chat-template", "--num-rollout", "1"]
    argv += ["--rollout-batch-size", "2", "--global-batch-size", "2", "--output-dir", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--loss-type sft_loss --prompt-data: {data}:2: 4 image tokens come after the first assistant turn" in err, (
        err
    )
