"""Issue 36 end to end: ``rl-plugin-train --custom-agent-function-path`` through real Ray actors on
both engines (hf, vLLM), one short rollout each, on the tiny random Llama with SmolLM2's tokenizer
and ChatML template. The agent (the real ``openai`` client, two append-only turns) writes the
``usage.completion_tokens`` it received to a file; the step's trained-token metric (``tokens``, the
loss-mask sum the trainer counted) equals their sum, and so does ``agent/model_tokens``."""

import json
import shutil

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("openai")

from rl_plugin.models.tiny import make_tiny_hf_checkpoint  # noqa: E402
from rl_plugin.train import main  # noqa: E402
from tests.support.local_ray import local_ray_cluster  # noqa: E402
from tests.support.real_tokenizer import smollm2_tokenizer_path  # noqa: E402

AGENT = """
import json
from openai import AsyncOpenAI

LOG = {log!r}


async def run_agent(base_url, prompt, request_kwargs=None):
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    msgs = [{{"role": "user", "content": prompt}}]
    got = []
    for turn in range(2):
        r = await client.chat.completions.create(model="m", messages=msgs, **{{**request_kwargs, "max_tokens": 3}})
        got.append(r.usage.completion_tokens)
        msgs = msgs + [r.choices[0].message.model_dump(exclude_none=True), {{"role": "user", "content": "Sure?"}}]
    with open(LOG, "a") as f:
        f.write(json.dumps(got) + "\\n")
    return float(len(r.choices[0].message.content or "") % 2)
"""


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    tok = smollm2_tokenizer_path()  # fetched before the cluster moves RL_PLUGIN_CACHE
    # head_dim 32: the smallest vLLM's CPU attention accepts (tiny_chat_checkpoint's is 8)
    model = make_tiny_hf_checkpoint(
        tmp_path_factory.mktemp("tiny_chat") / "m",
        "llama",
        vocab_size=49152,
        max_position_embeddings=1024,
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
    )
    for f in tok.iterdir():
        shutil.copy2(f, model / f.name)
    with local_ray_cluster(tmp_path_factory.mktemp("cache")):
        yield model


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_trained_tokens_equal_the_completion_tokens_the_agent_received(ray_cluster, tmp_path, engine):
    if engine == "vllm":
        pytest.importorskip("vllm")
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"What is {i} + 2?", "label": str(i + 2)}) for i in range(4)))
    log = tmp_path / "usage.jsonl"
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT.format(log=str(log)))
    out = tmp_path / "o"
    argv = ["--train-backend", "fsdp", "--rollout-engine", engine, "--hf-checkpoint", str(ray_cluster)]
    argv += [
        "--prompt-data",
        str(data),
        "--custom-agent-function-path",
        f"{agent}:run_agent",
        "--rm-type",
        "math_exact",
    ]
    argv += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8"]
    argv += ["--num-rollout", "1", "--micro-batch-size", "4", "--output-dir", str(out), "--no-progress-bar"]
    if engine == "vllm":
        argv += ["--rollout-num-gpus", "1"]
    assert main(argv) == 0
    usage = [json.loads(x) for x in log.read_text().splitlines()]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"reward_mean"' in x]
    assert len(usage) == 4 and len(rows) == 1
    served = sum(sum(u) for u in usage)
    print(f"{engine}: usage.completion_tokens served {served}, step tokens {rows[0]['tokens']}", flush=True)
    assert rows[0]["tokens"] == served == rows[0]["agent/model_tokens"] == rows[0]["agent/completion_tokens"]
    assert rows[0]["agent/calls"] == 8 and rows[0]["agent/non_append_turns"] == 0 and rows[0]["samples"] == 4
    assert 0 < rows[0]["agent/masked_token_frac"] < 1
