"""The hf engine generates from image + text (a Qwen2.5-VL checkpoint): each response's log-probs are
the model's on the prompt with its own image, and the default generate hands the images to the sample."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from rl_plugin.rollout.data.dataset import PromptRecord
from rl_plugin.rollout.data.vl_prompt import rollout_prompts
from rl_plugin.rollout.engines.base import SamplingParams
from rl_plugin.rollout.engines.hf_engine import HFEngine, image_inputs
from rl_plugin.rollout.generation.default import DefaultGenerate
from tests.support.tiny_vl import tiny_vl_dir, vl_rollout_config

PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6)
RED, BLUE = Image.new("RGB", (56, 56), (255, 0, 0)), Image.new("RGB", (84, 56), (0, 0, 255))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ckpt = tiny_vl_dir(tmp_path_factory.mktemp("vl"))
    return HFEngine(str(ckpt)), rollout_prompts(vl_rollout_config(apply_chat_template=True), ckpt)


def _model_log_probs(model, prompt, response_ids, mrope=True):
    ids = torch.tensor([list(prompt) + response_ids])
    kinds = torch.tensor([prompt.mm_token_type_ids + [0] * len(response_ids)])  # M-RoPE: the image tokens
    kinds = kinds if mrope else None  # None: 1-D positions (a model that never sees the image grid)
    grid = prompt.image_grid_thw
    logits = model(input_ids=ids, pixel_values=prompt.pixel_values, image_grid_thw=grid, mm_token_type_ids=kinds).logits
    start = len(prompt) - 1
    return logits[0, start : start + len(response_ids)].log_softmax(-1).gather(-1, torch.tensor(response_ids)[:, None])


def test_log_probs_are_the_models_on_each_prompts_own_image(setup):
    engine, prompts = setup
    red, blue = prompts.image_prompt("Colour? <image>", [RED]), prompts.image_prompt("Colour? <image>", [BLUE])
    blue2 = prompts.image_prompt("Colour <image>?", [BLUE])
    assert len(red) != len(blue) == len(blue2)  # two buckets, one of two different prompts
    gens = engine.generate([red, red, blue, blue2], PARAMS, seed=0)
    # no special id sampled at this seed: the reference forward would take a response <|image_pad|> for an image
    assert all(t < 256 for g in gens for t in g.response_ids)
    for prompt, g in zip([red, red, blue, blue2], gens):
        assert g.prompt_ids == list(prompt) and len(g.response_ids) >= 1
        want = _model_log_probs(engine.model, prompt, g.response_ids).squeeze(-1)
        torch.testing.assert_close(torch.tensor(g.log_probs), want, atol=2e-5, rtol=0)
    # the positions are M-RoPE's (the image's 2-D grid), not 1-D
    flat = _model_log_probs(engine.model, blue, gens[2].response_ids, mrope=False).squeeze(-1)
    assert (flat - torch.tensor(gens[2].log_probs)).abs().max() > 1e-4
    # the image is in the prefill: the same text with the other image scores the same response otherwise
    swapped = prompts.image_prompt("Colour? <image>", [Image.new("RGB", (56, 56), (0, 255, 0))])
    other = _model_log_probs(engine.model, swapped, gens[0].response_ids).squeeze(-1)
    assert (other - torch.tensor(gens[0].log_probs)).abs().max() > 1e-3


def test_a_bucket_mixing_text_and_image_prompts_is_refused(setup):
    _, prompts = setup
    with pytest.raises(ValueError, match="mixes prompts with and without images"):
        image_inputs([prompts.image_prompt("x", [RED]), [1, 2, 3]], "cpu")
    assert image_inputs([[1, 2], [3, 4]], "cpu") == {}


def test_default_generate_gives_each_sample_its_images(setup, tmp_path):
    engine, prompts = setup
    RED.save(tmp_path / "r.png")
    BLUE.save(tmp_path / "b.png")
    recs = [
        PromptRecord("Colour? <image>", 0, 0, 1, None, "d:1", [str(tmp_path / "r.png")]),
        PromptRecord("Colour? <image>", 1, 1, 2, None, "d:2", [str(tmp_path / "b.png")]),
    ]
    gen = DefaultGenerate(prompts, PARAMS, engine, [])
    samples = gen(recs, 2, seed=0)
    colours = [s.multimodal_inputs["image"][0].getpixel((0, 0)) for s in samples]
    assert colours == [(255, 0, 0)] * 2 + [(0, 0, 255)] * 2
    grids = [s.multimodal_train_inputs["image_grid_thw"].tolist() for s in samples]
    assert grids == [[[1, 4, 4]]] * 2 + [[[1, 4, 6]]] * 2
    assert samples[0].prompt.count("<|image_pad|>") == 1  # sample.prompt: the template's text, unexpanded
    assert samples[2].tokens[: samples[2].prompt_length].count(prompts.processor.image_token_id) == 6
