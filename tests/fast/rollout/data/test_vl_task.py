"""The embedded colour task: one text prompt for every label, the label only in the image, and a reward
that reads the first response token's class and refuses a sample without its image."""

from __future__ import annotations

import asyncio
import json
import types

import pytest
from PIL import Image

from rl_plugin.rollout.data.vl_task import PROMPT, answer_class, colour_reward, write_colour_task
from rl_plugin.rollout.sample import Sample


def test_the_text_is_the_same_for_every_label_and_the_image_tells(tmp_path):
    train, ev = write_colour_task(tmp_path, num_train=40, num_eval=8, num_colours=3)
    recs = [json.loads(line) for line in train.read_text().splitlines()]
    assert {r["prompt"] for r in recs} == {PROMPT} and {r["label"] for r in recs} == {"0/3", "1/3", "2/3"}
    for r in recs:
        pixel = Image.open(tmp_path / r["images"][0]).getpixel((0, 0))
        assert max(range(3), key=lambda c: pixel[c]) == [0, 2, 1][int(r["label"][0])]  # red, blue, green dominate
    eval_images = {json.loads(line)["images"][0] for line in ev.read_text().splitlines()}
    assert len(eval_images) == 8 and not eval_images & {r["images"][0] for r in recs}


def test_reward_is_the_first_tokens_class_and_needs_the_image(tmp_path):
    train, _ = write_colour_task(tmp_path, num_train=2, num_eval=1, num_colours=2)
    args = types.SimpleNamespace(prompt_data=str(train))
    img = {"image": [Image.new("RGB", (4, 4))]}
    right = Sample(index=0, tokens=[5, 6, 7, 9], response_length=2, label="1/2", multimodal_inputs=img)
    wrong = Sample(index=1, tokens=[5, 6, 8, 9], response_length=2, label="1/2", multimodal_inputs=img)
    assert asyncio.run(colour_reward(args, right)) == 1.0 and asyncio.run(colour_reward(args, wrong)) == 0.0
    assert answer_class(263, 2) == 1 and answer_class(8, 4) == 0
    with pytest.raises(ValueError, match="sample 1 reached the reward without its image"):
        asyncio.run(colour_reward(args, Sample(index=1, tokens=[1, 2], response_length=1, label="0/2")))
    with pytest.raises(ValueError, match="num_colours must be in"):
        write_colour_task(tmp_path, num_colours=5)
