"""Issue 46 (slime #1847: multi-turn rollouts where the model never sees the image): a custom generate
hook's sample carries its prompt's image, ``append_image`` adds one in a tool turn (image tokens with
loss mask 0, pixels appended in order), and the hf engine's second turn sees both images."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from rl_plugin.models.tiny_vl import IMAGE_ID
from rl_plugin.rollout.data.dataset import PromptRecord
from rl_plugin.rollout.data.vl_prompt import rollout_prompts
from rl_plugin.rollout.engines.base import SamplingParams
from rl_plugin.rollout.engines.hf_engine import HFEngine
from rl_plugin.rollout.generation.hooks import Hook, HookError, engine_dispatch, fresh_samples, run_generate_hook
from rl_plugin.rollout.sample import Sample
from rl_plugin.rollout.vl_turns import check_image_tokens, drop_cut_images, image_token_mask
from tests.support.tiny_vl import tiny_vl_dir, vl_rollout_config

PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=3)
RED = (255, 0, 0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("vl")
    ckpt = tiny_vl_dir(base)
    Image.new("RGB", (56, 56), (0, 0, 255)).save(base / "blue.png")
    return HFEngine(str(ckpt)), rollout_prompts(vl_rollout_config(apply_chat_template=True), ckpt), base


def run_hook(setup, name, metadata, n=2, seed=3):
    engine, prompts, base = setup
    recs = [PromptRecord("Colour <image> and then?", 0, 0, 1, dict(metadata), "d:1", [str(base / "blue.png")])]
    samples = fresh_samples(prompts, recs, n)
    hook = Hook.load(f"tests.support.vl_hooks:{name}", "--custom-generate-function-path")
    from rl_plugin.rollout.generation.hooks import default_sampling_params

    out = run_generate_hook(
        hook,
        None,
        samples,
        default_sampling_params(PARAMS),
        engine_dispatch(engine, []),
        seed,
        PARAMS,
        vocab_size=264,
        prompts=prompts,
    )
    return out, prompts, hook


def forward_log_probs(model, s: Sample, pixel_values=None) -> torch.Tensor:
    """The HF model's log-probs of ``s``'s response tokens given all its images (its image tokens marked)."""
    kinds = torch.tensor([image_token_mask(s.tokens, s.response_length, s.loss_mask, IMAGE_ID)])
    train = s.multimodal_train_inputs
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor([s.tokens]),
            pixel_values=train["pixel_values"] if pixel_values is None else pixel_values,
            image_grid_thw=train["image_grid_thw"],
            mm_token_type_ids=kinds,
        ).logits[0]
    start = len(s.tokens) - s.response_length
    rows = logits[start - 1 : -1].double().log_softmax(-1)
    return rows.gather(1, torch.tensor(s.tokens[start:]).view(-1, 1)).squeeze(1)


def test_the_image_token_mask_marks_prompt_images_and_appended_ones_only():
    #          prompt: image    response: sampled pad (mask 1), appended pads (mask 0), text
    tokens = [1, IMAGE_ID, IMAGE_ID, 2, IMAGE_ID, 5, IMAGE_ID, IMAGE_ID, 7]
    assert image_token_mask(tokens, 5, [1, 1, 0, 0, 1], IMAGE_ID) == [0, 1, 1, 0, 0, 0, 1, 1, 0]
    assert image_token_mask(tokens, 5, None, IMAGE_ID) == [0, 1, 1, 0, 0, 0, 0, 0, 0]


def test_a_tool_turn_image_reaches_the_engine_and_the_sample(setup):
    from rl_plugin.models.vl_processor import encode

    engine, _, _ = setup
    samples, prompts, _ = run_hook(setup, "image_tool_turn", {"tool_colour": RED})
    for s in samples:
        train = s.multimodal_train_inputs
        assert train["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 4]]  # the prompt's image, then the tool's
        assert [im.getpixel((0, 0)) for im in s.multimodal_inputs["image"]] == [(0, 0, 255), RED]
        mask = torch.tensor(s.loss_mask)
        kinds = torch.tensor(image_token_mask(s.tokens, s.response_length, s.loss_mask, IMAGE_ID))
        start = len(s.tokens) - s.response_length
        assert int(kinds[:start].sum()) == 4 and int(kinds[start:].sum()) == 6  # 16 / 4 and 24 / 4 tokens
        assert bool((mask[kinds[start:].bool()] == 0).all())  # image tokens are never trained
        assert int(mask.sum()) == 6  # two turns of 3 model tokens
    # the group shares the prompt's tensors; each sample's tool image is its own
    assert samples[0].multimodal_train_inputs["pixel_values"] is not samples[1].multimodal_train_inputs["pixel_values"]
    # the engine's log-probs (both turns) are the model's with both images
    grey = encode(prompts.processor, prompts.placeholder, [Image.new("RGB", (56, 84), (128, 128, 128))])[1]
    for s in samples:
        got = torch.tensor(s.rollout_log_probs, dtype=torch.float64)
        trained = torch.tensor(s.loss_mask).bool()
        want = forward_log_probs(engine.model, s)
        torch.testing.assert_close(got[trained], want[trained], atol=2e-5, rtol=0)
        # the second turn depends on the tool's image: with a grey one instead it scores otherwise
        pixels = s.multimodal_train_inputs["pixel_values"]
        swapped = forward_log_probs(engine.model, s, torch.cat([pixels[:16], grey]))
        turn2 = trained.clone()
        turn2[: s.response_length - 3] = False
        assert (swapped[turn2] - want[turn2]).abs().max() > 1e-3
        torch.testing.assert_close(swapped[trained & ~turn2], want[trained & ~turn2], atol=1e-6, rtol=0)


def test_a_sampled_image_pad_in_an_earlier_turn_stays_text_for_the_engine(setup):
    """Without ``hf_sampler.image_places`` generate counts the sampled id as an image place (a count
    mismatch); with it, the engine's second turn equals the forward that marks only real images."""
    engine, _, _ = setup
    samples, _, _ = run_hook(setup, "image_tool_turn", {"tool_colour": RED, "sampled_pad": True}, n=1)
    s = samples[0]
    start = len(s.tokens) - s.response_length
    assert s.tokens[start + 3] == IMAGE_ID and s.loss_mask[3] == 1
    trained = torch.tensor(s.loss_mask).bool()
    trained[3] = False  # the injected id: not a sampled token
    got = torch.tensor(s.rollout_log_probs, dtype=torch.float64)
    # the reference: the image features placed by hand at the marked tokens only, M-RoPE over them
    model, inner = engine.model, engine.model.model
    ids = torch.tensor([s.tokens])
    kinds = torch.tensor([image_token_mask(s.tokens, s.response_length, s.loss_mask, IMAGE_ID)])
    train = s.multimodal_train_inputs
    with torch.no_grad():
        embeds = inner.get_input_embeddings()(ids)
        feats = inner.get_image_features(train["pixel_values"], train["image_grid_thw"], return_dict=True)
        embeds[kinds.bool()] = torch.cat(feats.pooler_output)
        positions, _ = inner.get_rope_index(ids, kinds, image_grid_thw=train["image_grid_thw"])
        logits = model(inputs_embeds=embeds, position_ids=positions).logits[0]
    rows = logits[start - 1 : -1].double().log_softmax(-1)
    want = rows.gather(1, ids[0, start:].view(-1, 1)).squeeze(1)
    torch.testing.assert_close(got[trained], want[trained], atol=2e-5, rtol=0)


def test_a_hook_that_passes_image_tokens_without_the_sample_is_refused(setup):
    with pytest.raises(HookError, match=r"input_ids hold image tokens and no images reach the engine.*sample=sample"):
        run_hook(setup, "forgets_the_sample", {})


def test_image_tokens_without_pixels_are_refused_naming_the_sample(setup):
    samples, _, hook = run_hook(setup, "pads_by_hand", {}, n=1)
    with pytest.raises(
        ValueError, match=r"sample 0 \(group 0.*8 image tokens .* for 1 images of 4 tokens.*append_image"
    ):
        check_image_tokens(samples, IMAGE_ID, 2, hook.describe())


def test_a_cut_keeps_whole_images_only(setup):
    samples, _, _ = run_hook(setup, "image_tool_turn", {"tool_colour": RED}, n=1)
    s = samples[0]
    start = len(s.tokens) - s.response_length
    first_tool_pad = s.tokens.index(IMAGE_ID, start)
    keep = first_tool_pad + 2 - start  # the cut lands inside the tool image
    s.tokens, s.response_length = s.tokens[: start + keep], keep
    s.loss_mask, s.rollout_log_probs = s.loss_mask[:keep], s.rollout_log_probs[:keep]
    drop_cut_images(s, IMAGE_ID, 2)
    assert s.multimodal_train_inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert s.multimodal_train_inputs["pixel_values"].shape[0] == 16 and len(s.multimodal_inputs["image"]) == 1
    assert s.tokens[-1] != IMAGE_ID and len(s.tokens) == first_tool_pad  # cut before the image's first token
    check_image_tokens([s], IMAGE_ID, 2, "hook")


def test_a_rollout_function_gets_its_samples_images_too(setup):
    from types import SimpleNamespace

    from rl_plugin.rollout.generation.hooks import DataSource, run_rollout_function

    engine, prompts, base = setup
    recs = [PromptRecord("Colour <image>?", 0, 0, 1, {"tool_colour": RED}, "d:1", [str(base / "blue.png")])]
    source = DataSource(lambda k: recs[:k], prompts, 2)
    hook = Hook.load("tests.support.vl_hooks:image_rollout_fn", "--rollout-function-path")
    groups = run_rollout_function(
        hook, SimpleNamespace(rollout_batch_size=1), 0, source, engine_dispatch(engine, []), 0, PARAMS, prompts=prompts
    )
    for s in groups[0]:
        assert s.multimodal_train_inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 4]]
        trained = torch.tensor(s.loss_mask).bool()
        got = torch.tensor(s.rollout_log_probs, dtype=torch.float64)
        torch.testing.assert_close(got[trained], forward_log_probs(engine.model, s)[trained], atol=2e-5, rtol=0)


def test_text_and_image_requests_of_one_length_share_an_engine_call(setup):
    """A text-only turn (an agent's) batched with an image turn of the same length: separate buckets
    (before: 'a bucket mixes prompts with and without images')."""
    engine, prompts, _ = setup
    image = prompts.image_prompt("Colour <image>?", [Image.new("RGB", (56, 56), (0, 0, 255))])
    text = list(range(65, 65 + len(image)))
    gens = engine.generate([image, text], PARAMS, seed=0)
    assert [g.prompt_ids for g in gens] == [list(image), text] and all(g.response_ids for g in gens)
