"""Issue 46 (slime #1847): images on the agent endpoint. The agent (the real ``openai`` client) gets a
record's image as an ``image_url`` data URI, sends it back, and adds a red image as an ``image_url``
part of its second turn; the hf engine's second turn sees both, and the episode's one sample carries
both images, their tokens at loss mask 0 (the rollout manager runs in this process)."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

pytest.importorskip("openai")

from rl_plugin.arguments.embedded import parse_train_flags  # noqa: E402
from rl_plugin.configs import RolloutConfig  # noqa: E402
from rl_plugin.models.tiny_vl import IMAGE_ID  # noqa: E402
from rl_plugin.rollout.manager import RolloutManager  # noqa: E402
from tests.support import agent_programs as agents  # noqa: E402
from tests.support.tiny_vl import tiny_vl_dir  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent_vl")
    model = tiny_vl_dir(root)
    Image.new("RGB", (56, 56), (0, 0, 255)).save(root / "blue.png")
    data = root / "train.jsonl"
    data.write_text(json.dumps({"prompt": "Colour <image>?", "images": ["blue.png"], "label": "0"}) + "\n")
    return root, model, data


def manager(setup, agent: str) -> RolloutManager:
    root, model, data = setup
    agents.SEEN.clear()
    argv = ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rollout-batch-size", "1"]
    argv += ["--n-samples-per-prompt", "2", "--rollout-max-response-len", "6", "--num-rollout", "1"]
    argv += ["--multimodal-keys", '{"image": "images"}', "--apply-chat-template", "--train-backend", "fsdp"]
    argv += ["--custom-agent-function-path", f"tests.support.agent_programs:{agent}", "--output-dir", str(root / "o")]
    args = parse_train_flags(argv)
    return RolloutManager(RolloutConfig.from_args(args), args.hf_checkpoint, args.prompt_data, None, args=args)


def forward(model, ids, resp_len, kinds, pixels, grid) -> torch.Tensor:
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor([ids]), pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=kinds[None]
        ).logits[0]
    start = len(ids) - resp_len
    return logits[start - 1 : -1].double().log_softmax(-1).gather(1, torch.tensor(ids[start:])[:, None])[:, 0]


def test_an_image_url_in_turn_two_reaches_the_model_and_the_sample(setup):
    from rl_plugin.models.vl_processor import encode

    m = manager(setup, "image_in_turn_two")
    data = m.generate(0)
    seen = agents.SEEN["image_in_turn_two"]
    assert len(seen) == 2 and data.stats["agent/non_append_turns"] == 0 and data.stats["agent/samples"] == 2
    prompt = seen[0][0]  # the record's image, handed to the agent as an image_url data URI
    parts = prompt[-1]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url", "text"]  # "Colour <image>?"
    assert parts[1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert data.image_counts.tolist() == [2, 2]
    assert data.image_grid_thw.tolist() == [[1, 4, 4], [1, 6, 4]] * 2  # the prompt's image, then turn 2's
    engine = m.generation.fleet.engine
    prompts = m.generation.tokenizer
    grey = encode(prompts.processor, prompts.placeholder, [Image.new("RGB", (56, 84), (128, 128, 128))])[1]
    toks = data.tokens.split(data.total_lengths.tolist())
    rl = data.response_lengths.tolist()
    masks, lps = data.loss_mask.split(rl), data.rollout_log_probs.split(rl)
    pixels = data.pixel_values.split([16 + 24] * 2)
    for i, (t, r, mask, lp) in enumerate(zip(toks, rl, masks, lps)):
        ids = t.tolist()
        start = len(ids) - r
        kinds = torch.tensor(ids) == IMAGE_ID
        kinds[start:] &= mask == 0  # the response's image tokens: turn 2's image, never trained
        assert int(kinds[:start].sum()) == 4 and int(kinds[start:].sum()) == 6
        assert int(mask.sum()) == 6 and data.stats["agent/model_tokens"] == 12  # 3 + 3 model tokens
        grid = data.image_grid_thw[2 * i : 2 * i + 2]
        want = forward(engine.model, ids, r, kinds.long(), pixels[i], grid)
        trained = mask.bool()
        torch.testing.assert_close(lp.double()[trained], want[trained], atol=2e-5, rtol=0)
        # turn 2 depends on the image the agent sent: a grey one scores its tokens otherwise
        swapped = forward(engine.model, ids, r, kinds.long(), torch.cat([pixels[i][:16], grey]), grid)
        turn2 = trained.clone()
        turn2[: r - 3] = False
        assert (swapped[turn2] - want[turn2]).abs().max() > 1e-3


def _chat_images(setup):
    from rl_plugin.rollout.agent.images import ChatImages
    from rl_plugin.rollout.agent.sessions import Session
    from rl_plugin.rollout.agent.template import ChatTemplate
    from rl_plugin.rollout.data.vl_prompt import rollout_prompts
    from rl_plugin.rollout.sample import Sample
    from tests.support.tiny_vl import vl_rollout_config

    prompts = rollout_prompts(vl_rollout_config(apply_chat_template=True), setup[1])
    return ChatImages(prompts), ChatTemplate(prompts.tok), Session("s", Sample(), 8)


def test_image_parts_by_file_path_and_the_refusals_name_messages(setup):
    from rl_plugin.rollout.agent.chat import RequestError

    images, tpl, session = _chat_images(setup)
    path = str(setup[0] / "blue.png")

    def ask(*parts):
        msgs = [{"role": "user", "content": list(parts)}]
        return images.prompt(session, tpl.render(msgs), msgs)

    text = {"type": "text", "text": "colour?"}
    for url in (path, "file://" + path):
        ids, appended, kept = ask({"type": "image_url", "image_url": {"url": url}}, text)
        assert not appended and kept["image_grid_thw"].tolist() == [[1, 4, 4]] and sum(ids.mm_token_type_ids) == 4
        assert images.collapse(tpl.decode(list(ids))).count(images.placeholder) == 1
    cases = [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "is not a readable image"),
        ({"type": "image_url", "image_url": {"url": str(setup[0] / "none.png")}}, "no such file"),
        ({"type": "image_url"}, "an image part needs image_url.url"),
        ({"type": "text", "text": images.placeholder}, "renders 1 image places for 0 image_url parts"),
        ({"type": "text", "text": "<|image_pad|>"}, "1 image-pad tokens for 0 images of 0 tokens"),
    ]
    for part, message in cases:
        with pytest.raises(RequestError, match=message) as err:
            ask(part, text)
        assert err.value.status == 400 and err.value.param == "messages"
