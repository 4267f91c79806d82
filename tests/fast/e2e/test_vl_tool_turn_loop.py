"""Issue 46 (slime #1847): an image shown only in a tool turn is seen by the engine and the trainer in
the real loop (``rl-plugin-train``, Ray actors, FSDP, the hf engine, weight sync checked bitwise).
Megatron places tool-turn images through the same ``models.vl_positions``: run once with
``--train-backend megatron`` it passes the same assertions (30 s; not repeated here, to keep the
suite short). Not with vLLM: the tiny model samples the image token in turn 1, which vLLM would
expand as an image's placeholder (``vllm_images.collapsed_ids`` refuses such a history by name).

The colour task with every prompt image grey: a custom generate hook
(``tests.support.vl_hooks:colour_tool_turn``) lets the model say one token, shows the label's colour in
a tool turn (``append_image``), and takes the answer from turn 2's token (id mod 2). Only the tool's
image tells the label, so a policy that never sees it stays at 0.5. Measured (this CPU, 26 s): the
reward goes 0.50 (rollouts 1-5) -> 0.88 (16-20), 0.92 at rollout 20; trainer and engine agree to
< 1e-5.
"""

import json

import pytest

ray = pytest.importorskip("ray")

from PIL import Image  # noqa: E402

from rl_plugin.rollout.data.vl_task import write_colour_task  # noqa: E402
from rl_plugin.train import main  # noqa: E402
from tests.support.local_ray import local_ray_cluster  # noqa: E402
from tests.support.tiny_vl import tiny_vl_dir  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    model = tiny_vl_dir(tmp_path_factory.mktemp("vl"))
    with local_ray_cluster(tmp_path_factory.mktemp("cache")):
        yield model


def test_the_colour_shown_in_a_tool_turn_is_learned(ray_cluster, tmp_path):
    train, _ = write_colour_task(tmp_path / "task", num_train=256, num_eval=4, num_colours=2)
    for png in (tmp_path / "task" / "images").glob("*.png"):  # the prompt's image tells nothing
        with Image.open(png) as im:
            size = im.size
        Image.new("RGB", size, (128, 128, 128)).save(png)
    out = tmp_path / "o"
    argv = [
        *("--train-backend", "fsdp", "--hf-checkpoint", str(ray_cluster)),
        *("--prompt-data", str(train)),
        *("--multimodal-keys", '{"image": "images"}', "--apply-chat-template"),
        *("--custom-generate-function-path", "tests.support.vl_hooks:colour_tool_turn"),
        *("--custom-rm-path", "tests.support.vl_hooks:tool_colour_reward"),
        *("--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "2"),
        *("--num-rollout", "20", "--global-batch-size", "64", "--micro-batch-size", "16", "--lr", "3e-3"),
        *("--check-weight-sync", "--output-dir", str(out), "--no-progress-bar"),
    ]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    assert len(rewards) == 20
    # 2 model tokens per sample are trained; the tool turn (its image tokens too) never is
    assert all(r["multi_turn/model_tokens"] == 128.0 for r in rows if "multi_turn/model_tokens" in r)
    assert max(r["rollout_log_prob_diff"] for r in rows if "rollout_log_prob_diff" in r) < 1e-5
    assert sum(rewards[:3]) / 3 < 0.7 and sum(rewards[-3:]) / 3 >= 0.85, rewards
