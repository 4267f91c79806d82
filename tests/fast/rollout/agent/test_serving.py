"""One rollout's endpoint state (``rl_plugin.rollout.agent.serving``) on a real ``hf`` engine (a
tiny random Qwen2, vocabulary 16) with SmolLM2's real tokenizer as the template: a completion on
token ids is the engine's generation recorded in the session (budget spent, append-only ids), an
exhausted budget answers "length" with no engine call, ids outside the vocabulary are 400s naming
the id and its place, and an engine that raises is a 500 kept as the rollout's failure."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoTokenizer

from rl_plugin.configs import EngineConfig
from rl_plugin.models.tiny import make_tiny_hf_checkpoint
from rl_plugin.rollout.agent.chat import RequestError
from rl_plugin.rollout.agent.serving import MODEL_NAME, Serving, check_vocab
from rl_plugin.rollout.agent.sessions import SessionTable
from rl_plugin.rollout.agent.template import ChatTemplate
from rl_plugin.rollout.engines.base import SamplingParams, make_engine
from rl_plugin.rollout.generate import EngineRouter
from rl_plugin.rollout.generation.hooks import engine_dispatch
from rl_plugin.rollout.sample import Sample
from tests.support import real_tokenizer

smollm2_tokenizer_dir = real_tokenizer.smollm2_tokenizer_dir  # the session fixture
VOCAB = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    torch.set_num_threads(1)
    ck = make_tiny_hf_checkpoint(
        tmp_path_factory.mktemp("serving") / "m", "qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64
    )
    return make_engine(EngineConfig(engine="hf"), str(ck))


def _serving(engine, tok_dir, dispatch=None):
    router = EngineRouter(
        dispatch or engine_dispatch(engine, []), seed=5, defaults=SamplingParams(max_new_tokens=6), vocab_size=VOCAB
    )
    return Serving(SessionTable(), router, ChatTemplate(AutoTokenizer.from_pretrained(tok_dir)), 7, vocab_size=VOCAB)


def test_check_vocab_names_the_first_id_outside():
    check_vocab([0, 15], 16, "prompt")
    check_vocab([99], None, "prompt")  # no bound known
    with pytest.raises(RequestError) as info:
        check_vocab([3, 16, -1], 16, "prompt")
    assert (info.value.status, info.value.param) == (400, "prompt")
    assert info.value.message == (
        "prompt: token id 16 (position 1) is outside the model's vocabulary [0, 16); send ids the model's tokenizer produced"
    )


def test_a_completion_on_ids_is_the_engines_generation_recorded(engine, smollm2_tokenizer_dir):
    serving = _serving(engine, smollm2_tokenizer_dir)
    session = serving.table.open(Sample(prompt="p"), budget=10)

    async def run():
        first = await serving.completion(session, {"prompt": [1, 5, 6, 3], "max_tokens": 4, "logprobs": 1})
        rec = session.records[0]
        follow = rec.full_ids + [4]
        second = await serving.completion(session, {"prompt": follow, "return_prompt_token_ids": True})
        return first, second

    first, second = asyncio.run(run())
    r0, r1 = session.records
    choice = first["choices"][0]
    assert first["model"] == MODEL_NAME and choice["token_ids"] == r0.output_ids
    assert 1 <= len(r0.output_ids) <= 4 and r0.prompt_ids == [1, 5, 6, 3] and not r0.appended
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(r0.log_probs)
    assert choice["finish_reason"] == r0.finish_reason and r0.version == 7
    # the second request extends the first's prompt + output: appended; it asks what the budget left
    assert r1.appended and r1.prompt_ids == r0.full_ids + [4]
    assert len(r1.output_ids) <= min(6, 10 - len(r0.output_ids))
    assert second["prompt_token_ids"] == r1.prompt_ids
    assert session.spent == len(r0.output_ids) + len(r1.output_ids) and session.reserved == 0
    assert serving.router.calls == 2


def test_an_exhausted_budget_answers_length_without_an_engine_call(engine, smollm2_tokenizer_dir):
    serving = _serving(engine, smollm2_tokenizer_dir)
    session = serving.table.open(Sample(), budget=0)
    out = asyncio.run(serving.completion(session, {"prompt": [1, 5, 3]}))
    assert out["choices"][0]["finish_reason"] == "length" and out["choices"][0]["token_ids"] == []
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
    assert serving.router.calls == 0 and session.records == []


def test_bad_prompts_are_400s(engine, smollm2_tokenizer_dir):
    serving = _serving(engine, smollm2_tokenizer_dir)
    session = serving.table.open(Sample(), budget=8)
    cases = [
        ({"prompt": [1, 5, 20]}, "prompt", "prompt: token id 20 (position 2) is outside"),
        ({"prompt": [1], "stop_token_ids": [3, 400]}, "stop_token_ids", "stop_token_ids: token id 400 (position 1)"),
        ({"prompt": []}, "prompt", "prompt: must be a non-empty string or a list of token ids"),
        ({"prompt": [1, True]}, "prompt", "prompt: must be a non-empty string or a list of token ids"),
    ]
    for body, param, message in cases:
        with pytest.raises(RequestError) as info:
            asyncio.run(serving.completion(session, body))
        assert info.value.param == param and info.value.message.startswith(message), info.value.message
    assert serving.router.calls == 0 and session.spent == 0


def test_an_engine_that_raises_is_a_500_kept_as_the_failure(engine, smollm2_tokenizer_dir):
    async def broken(prompts, params, seed):
        raise RuntimeError("CUDA error: device-side assert triggered")

    serving = _serving(engine, smollm2_tokenizer_dir, dispatch=broken)
    session = serving.table.open(Sample(), budget=8)
    with pytest.raises(RequestError) as info:
        asyncio.run(serving.completion(session, {"prompt": [1, 5, 3]}))
    assert (info.value.status, info.value.kind) == (500, "engine_error")
    assert info.value.message == "the engine failed: CUDA error: device-side assert triggered"
    exc, failed = serving.failure
    assert failed is session and str(exc) == "CUDA error: device-side assert triggered"
    assert session.ended == "engine error: CUDA error: device-side assert triggered"
    assert session.reserved == 0 and session.spent == 0
