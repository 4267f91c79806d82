"""Issue 22: a chat-message dataset through the real loop (``rl-plugin-train``, Ray actors, both
backends, the hf engine) with --apply-chat-template on SmolLM2's real tokenizer and ChatML template.

The model is a tiny random Llama that carries SmolLM2's tokenizer (vocabulary 49,152, hidden 32),
so one rollout costs seconds; the real 135M model runs in examples/real_model_smollm2.sh. The
reward function takes ``metadata`` and returns the record's ``metadata["w"]`` after checking that
its prompt is the record's messages rendered by the chat template (slime's ``Sample.prompt``, issue
37 #11: the same text a generate hook's samples carry): the rollout's mean reward then equals the mean
weight of its prompts exactly, which proves the messages and metadata reached the reward. JSONL
trains on Megatron, Parquet on FSDP.
"""

import json

import pytest

ray = pytest.importorskip("ray")

from rl_plugin.models.smollm2 import tiny_chat_checkpoint  # noqa: E402
from rl_plugin.train import main  # noqa: E402
from tests.fast.rollout.data.test_tokenizer import _write_chat_data  # noqa: E402
from tests.fast.rollout.engines.test_engines import MEAN_BOUND  # noqa: E402
from tests.support.local_ray import local_ray_cluster  # noqa: E402
from tests.support.real_tokenizer import smollm2_tokenizer_path  # noqa: E402

WEIGHTS = [0.0, 0.25, 0.5, 1.0]
ROWS = [
    {
        "messages": [
            {"role": "system", "content": "Answer with the number only."},
            {"role": "user", "content": f"What is {i} + 2?"},
        ],
        "label": str(i + 2),
        "meta": {"w": w},
    }
    for i, w in enumerate(WEIGHTS)
]
REWARD = """
def reward(prompt, response, label, metadata):
    ok = isinstance(prompt, str) and prompt.startswith("<|im_start|>system\\nAnswer with the number only.<|im_end|>")
    if not (ok and " + 2?<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\\n")):
        raise ValueError(f"the reward got {prompt!r}, not the record's messages after the chat template")
    return float(metadata["w"])
"""


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    tok = smollm2_tokenizer_path()  # fetched before the cluster moves RL_PLUGIN_CACHE
    model = tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat"), tok.parent)
    with local_ray_cluster(tmp_path_factory.mktemp("cache")):
        yield model


@pytest.mark.parametrize("backend, suffix", [("megatron", "jsonl"), ("fsdp", "parquet")])
def test_chat_messages_train_one_rollout(ray_cluster, tmp_path, backend, suffix):
    data = _write_chat_data(tmp_path / f"chat.{suffix}", ROWS)
    rm = tmp_path / "rm.py"
    rm.write_text(REWARD)
    out = tmp_path / "o"
    argv = [
        "--train-backend",
        backend,
        "--hf-checkpoint",
        str(ray_cluster),
        "--prompt-data",
        str(data),
        "--input-key",
        "messages",
        "--metadata-key",
        "meta",
        "--apply-chat-template",
        "--apply-chat-template-kwargs",
        '{"enable_thinking": false}',
        "--custom-rm-path",
        f"{rm}:reward",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "4",
        "--num-rollout",
        "1",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "4",
        "--output-dir",
        str(out),
        "--no-progress-bar",
    ]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"reward_mean"' in x]
    assert len(rows) == 1 and rows[0]["reward_mean"] == pytest.approx(sum(WEIGHTS) / 4, abs=1e-7)
    assert rows[0]["samples"] == 8 and 8 <= rows[0]["tokens"] <= 8 * 4  # response tokens: 1..4 per sample
    assert rows[0]["rollout_log_prob_diff"] < MEAN_BOUND  # trainer and engine read the same ids
