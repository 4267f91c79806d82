"""The agent endpoint's OpenAI formats (``rl_plugin.rollout.agent.chat``): the sampling params a
request becomes (SGLang's spelling) and every refusal as a 400 naming the field; message content as
text; the tools described in the system message; ``<tool_call>`` blocks parsed into OpenAI
``tool_calls``; the chat and completion answers with ``usage`` and ``token_ids``."""

from __future__ import annotations

import json

import pytest

from rl_plugin.rollout.agent.chat import (
    CHAT_KEYS,
    COMPLETION_KEYS,
    RequestError,
    chat_answer,
    check_messages,
    completion_answer,
    parse_tool_calls,
    sampling_params,
    text_of,
    tools_block,
    with_tools_in_system,
)

ONE_TOKEN = {"<|im_end|>": 2, "<eos>": 7}


def _params(body, keys=CHAT_KEYS):
    return sampling_params(body, frozenset(keys), ONE_TOKEN.get)


def _refusal(body, keys=CHAT_KEYS):
    with pytest.raises(RequestError) as info:
        _params(body, keys)
    e = info.value
    assert e.status == 400 and e.body() == {
        "error": {"message": e.message, "type": "invalid_request_error", "param": e.param, "code": 400}
    }
    return e.param, e.message


def test_a_request_becomes_sglang_sampling_params():
    body = {
        "messages": [],
        "model": "m",
        "max_tokens": 9,
        "temperature": 1,
        "top_p": 0.5,
        "top_k": 4,
        "stop": ["<|im_end|>", 11],
        "stop_token_ids": [5, 2],
        "n": 1,
        "stream": False,
        "logprobs": True,
        "top_logprobs": 0,
    }
    assert _params(body) == {
        "max_new_tokens": 9,
        "temperature": 1.0,
        "top_p": 0.5,
        "top_k": 4,
        "stop_token_ids": [2, 5, 11],
    }
    assert _params({"max_completion_tokens": 3, "max_tokens": 9, "stop": "<eos>"}) == {
        "max_new_tokens": 3,  # max_completion_tokens wins
        "stop_token_ids": [7],
    }
    assert _params({}) == {"stop_token_ids": []}
    assert _params({"top_k": -1})["top_k"] == -1


@pytest.mark.parametrize(
    "body, param, message",
    [
        (
            {"frequency_penalty": 0.5, "seed": 1},
            "frequency_penalty",
            "frequency_penalty: not supported by this endpoint",
        ),
        ({"stream": True}, "stream", "stream: streaming is not supported: send stream=false"),
        ({"n": 2}, "n", "n: only n=1 is served (got 2); send one request per completion"),
        ({"top_logprobs": 5}, "top_logprobs", "top_logprobs: only 0 is served (got 5)"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens: must be an integer >= 1, got 0"),
        ({"max_tokens": True}, "max_tokens", "max_tokens: must be an integer >= 1, got True"),
        ({"temperature": "hot"}, "temperature", "temperature: must be a number, got 'hot'"),
        (
            {"temperature": 0},
            "temperature",
            "temperature: must be > 0 (got 0.0): a rollout samples, greedy is not served",
        ),
        ({"top_p": 1.5}, "top_p", "top_p: must be in (0, 1], got 1.5"),
        ({"top_k": 0}, "top_k", "top_k: must be an integer >= 1, or -1 for none; got 0"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids", "stop_token_ids: must be a list of token ids, got [1, -2]"),
        ({"stop_token_ids": 3}, "stop_token_ids", "stop_token_ids: must be a list of token ids, got 3"),
        ({"stop": "###"}, "stop", "stop: '###' is not one token of the model's tokenizer"),
    ],
)
def test_refusals_are_400s_naming_the_field(body, param, message):
    got_param, got = _refusal(body)
    assert got_param == param and got.startswith(message), got


def test_completion_only_rules():
    assert _refusal({"prompt": "x", "echo": True}, COMPLETION_KEYS) == (
        "echo",
        "echo: echo is not supported; ask for return_prompt_token_ids instead",
    )
    param, msg = _refusal({"prompt": "x", "logprobs": 5}, COMPLETION_KEYS)
    assert param == "logprobs" and msg.startswith("logprobs: only 0 or 1 is served (got 5)")
    assert _params({"prompt": "x", "logprobs": 1}, COMPLETION_KEYS) == {"stop_token_ids": []}
    assert _refusal({"messages": []}, COMPLETION_KEYS)[0] == "messages"  # a chat field on completions


def test_message_content_and_roles():
    assert text_of(None) == "" and text_of("hi") == "hi"
    assert text_of([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "ab"
    with pytest.raises(RequestError, match=r"^messages: a message's content must be text"):
        text_of([{"type": "image_url", "image_url": {}}])
    msgs = [{"role": "user", "content": "x"}]
    assert check_messages(msgs) is msgs
    for bad, rule in (([], "must be a non-empty list"), ([{"content": "x"}], "every message needs a role")):
        with pytest.raises(RequestError, match=f"^messages: {rule}"):
            check_messages(bad)


def test_tools_go_into_the_system_message():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    block = tools_block(tools)
    assert f"<tools>\n{json.dumps(tools[0])}\n</tools>" in block and block.startswith("# Tools\n\n")
    user = [{"role": "user", "content": "1+2?"}]
    assert with_tools_in_system(user, tools) == [{"role": "system", "content": block}] + user
    sys = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}] + user
    out = with_tools_in_system(sys, tools)
    assert out[0] == {"role": "system", "content": f"Be brief.\n\n{block}"} and out[1:] == user
    assert sys[0]["content"] == [{"type": "text", "text": "Be brief."}]  # the request is not modified


def test_tool_call_blocks_become_openai_tool_calls():
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "now", "parameters": {}}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me add."
    assert [c["function"] for c in calls] == [
        {"name": "add", "arguments": '{"a": 1}'},
        {"name": "now", "arguments": "{}"},
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    only = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert only[0] is None and only[1][0]["function"]["arguments"] == '{"x": 1}'  # a string stays as sent
    broken = "<tool_call>{not json}</tool_call> and <tool_call>[1]</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])


def test_chat_answer_with_tool_calls_logprobs_and_prompt_ids():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    out = chat_answer(
        None,
        calls,
        "stop",
        [1, 3, 4],
        [8, 9],
        [-0.5, -0.25],
        ["é", "b"],
        want_logprobs=True,
        want_prompt_ids=True,
        model="tiny",
    )
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-") and out["model"] == "tiny"
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": calls}
    assert choice["finish_reason"] == "tool_calls" and choice["token_ids"] == [8, 9]
    assert choice["logprobs"]["content"][0] == {"token": "é", "logprob": -0.5, "bytes": [195, 169], "top_logprobs": []}
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert out["prompt_token_ids"] == [1, 3, 4]
    cut = chat_answer(
        "x", calls, "length", [1], [8], [-1.0], ["x"], want_logprobs=False, want_prompt_ids=False, model="m"
    )
    assert cut["choices"][0]["finish_reason"] == "length" and cut["choices"][0]["logprobs"] is None
    assert "prompt_token_ids" not in cut


def test_completion_answer_offsets():
    out = completion_answer(
        "abcd",
        "stop",
        [1],
        [5, 6, 7],
        [-1, -2, -3],
        ["a", "bc", "d"],
        want_logprobs=True,
        want_prompt_ids=False,
        model="m",
    )
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["choices"][0]["logprobs"] == {
        "tokens": ["a", "bc", "d"],
        "token_logprobs": [-1.0, -2.0, -3.0],
        "top_logprobs": None,
        "text_offset": [0, 1, 3],
    }
    assert out["usage"]["completion_tokens"] == 3 and out["choices"][0]["text"] == "abcd"
