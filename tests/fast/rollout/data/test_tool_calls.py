"""Assistant ``tool_calls`` in chat data (``rl_plugin.rollout.data.tool_calls``): normalised to
OpenAI's form (arguments parsed, a null content read as ""), refused naming the message and the
call, and written into the content in the Hermes form for a template that ignores them."""

from __future__ import annotations

import json

import pytest

from rl_plugin.rollout.data.tool_calls import hermes_text, normalise, with_tool_calls_rendered

WHERE = "data.jsonl:7"


def _call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_calls_are_normalised_to_openais_form():
    m = {
        "role": "assistant",
        "content": None,
        "tool_calls": [_call("add", '{"a": 1, "b": 2}'), {"name": "now", "arguments": ""}, {"name": "id"}],
    }
    out = normalise(WHERE, "messages", 2, m)
    assert out == {
        "role": "assistant",
        "content": "",
        "tool_calls": [_call("add", {"a": 1, "b": 2}), _call("now", {}), _call("id", {})],
    }
    # no calls (missing, None or []): the message without the key
    assert normalise(WHERE, "messages", 0, {"role": "user", "content": "hi", "tool_calls": []}) == {
        "role": "user",
        "content": "hi",
    }
    plain = {"role": "assistant", "content": "x"}
    assert normalise(WHERE, "messages", 0, plain) == plain


@pytest.mark.parametrize(
    "message, expected",
    [
        (
            {"role": "user", "content": "", "tool_calls": [_call("f", {})]},
            "data.jsonl:7: message 3 of 'messages' has 'tool_calls' but the role 'user'; only an assistant turn calls tools",
        ),
        (
            {"role": "assistant", "content": "", "tool_calls": {"name": "f"}},
            "data.jsonl:7: message 3 of 'messages': 'tool_calls' must be a list of calls, got dict",
        ),
        (
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]},
            "data.jsonl:7: message 3 of 'messages': tool call 0 has no function name",
        ),
        (
            {"role": "assistant", "content": "", "tool_calls": [_call("f", {}), _call("g", "{oops")]},
            "data.jsonl:7: message 3 of 'messages': the arguments of tool call 1 (g) are not valid JSON",
        ),
        (
            {"role": "assistant", "content": "", "tool_calls": [_call("f", "[1, 2]")]},
            "data.jsonl:7: message 3 of 'messages': the arguments of tool call 0 (f) must be a JSON object, got [1, 2]",
        ),
    ],
)
def test_bad_calls_are_refused_naming_the_message_and_the_call(message, expected):
    with pytest.raises(ValueError) as info:
        normalise(WHERE, "messages", 3, message)
    assert str(info.value).startswith(expected), str(info.value)


def test_hermes_text_writes_each_call_after_the_content():
    calls = [_call("add", {"a": 1}), _call("né", {"s": "é"})]
    one = '\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    two = '\n<tool_call>\n{"name": "né", "arguments": {"s": "é"}}\n</tool_call>'
    assert hermes_text({"content": "Let me add.", "tool_calls": calls}) == "Let me add." + one + two
    assert hermes_text({"content": "", "tool_calls": calls}) == one[1:] + two  # no leading newline
    parsed = json.loads(hermes_text({"content": "", "tool_calls": calls[:1]}).split("\n")[1])
    assert parsed == {"name": "add", "arguments": {"a": 1}}


def test_rendering_depends_on_whether_the_template_reads_the_calls():
    msgs = [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("add", {"a": 1, "b": 2})]},
        {"role": "tool", "content": "3"},
    ]
    assert with_tool_calls_rendered(msgs, template_reads_them=True) is msgs
    rendered = with_tool_calls_rendered(msgs, template_reads_them=False)
    assert rendered[0] is msgs[0] and rendered[2] is msgs[2]
    assert rendered[1] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    }
    no_calls = [msgs[0]]
    assert with_tool_calls_rendered(no_calls, template_reads_them=False) is no_calls
