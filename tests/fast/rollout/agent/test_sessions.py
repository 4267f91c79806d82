"""Agent sessions (``rl_plugin.rollout.agent.sessions``): the episode budget reserved before an
engine call and settled after it (requests in flight share what is left), the append-only prompt
ids, the raw text of the session's own answers, and the 404 / 409 of the session table. A
character-level "tokenizer" (one id per character) stands in for the template's."""

from __future__ import annotations

import pytest

from rl_plugin.rollout.agent.chat import RequestError
from rl_plugin.rollout.agent.records import TurnRecord
from rl_plugin.rollout.agent.sessions import Session, SessionTable
from rl_plugin.rollout.sample import Sample


def encode(text):
    return [ord(c) for c in text]


def _record(prompt, output, raw=None):
    ids, out = encode(prompt), encode(output)
    return TurnRecord(ids, out, [-0.5] * len(out), "stop", False, raw_text=output if raw is None else raw)


def test_the_budget_is_reserved_and_settled():
    s = Session("s1", Sample(), budget=10)
    assert s.left == 10
    a = s.reserve(6)
    b = s.reserve(6)  # in flight together: the second gets what the first left
    assert (a, b, s.left) == (6, 4, 0)
    assert s.reserve(3) == 0
    s.settle(a, 2)  # the first stopped after 2 ids: its unused 4 come back
    assert (s.spent, s.reserved, s.left) == (2, 4, 4)
    s.settle(b, 4)
    assert (s.spent, s.reserved, s.left) == (6, 0, 4)
    s.settle(0, 7)  # produced more than reserved (never in practice): left stays >= 0
    assert s.left == 0


def test_a_turn_that_extends_the_previous_text_is_appended_with_the_engines_ids():
    s = Session("s1", Sample(), budget=100)
    first = "<u>hi</u><a>"
    full = lambda: encode("never called")  # noqa: E731
    assert s.prompt_ids(first, lambda: encode(first), encode) == (encode(first), False)  # no record yet
    rec = TurnRecord(encode(first), [1000, 1001], [-0.1, -0.2], "stop", False, raw_text="ĨĩX")
    s.add(rec, first + "Ĩĩ", content="Ĩĩ", tool_call_ids=[])
    ids, appended = s.prompt_ids(first + "Ĩĩ" + "<u>more</u>", full, encode)
    assert appended and ids == encode(first) + [1000, 1001] + encode("<u>more</u>")
    ids, appended = s.prompt_ids(first + "Ĩĩ", full, encode)  # nothing added: the ids as they were
    assert appended and ids == encode(first) + [1000, 1001]
    rewritten = "<u>bye</u><a>"
    assert s.prompt_ids(rewritten, lambda: encode(rewritten), encode) == (encode(rewritten), False)


def test_ids_extend_compares_with_the_previous_prompt_and_output():
    s = Session("s1", Sample(), budget=100)
    assert not s.ids_extend([1, 2])
    s.add(TurnRecord([1, 2], [3], [-1.0], "stop", False), "xyz", None, [])
    assert s.ids_extend([1, 2, 3]) and s.ids_extend([1, 2, 3, 4])
    assert not s.ids_extend([1, 2]) and not s.ids_extend([1, 9, 3, 4])


def test_the_sessions_own_answers_are_rendered_from_their_raw_text():
    s = Session("s1", Sample(), budget=100)
    s.add(_record("p", "ans", raw="RAW-1"), "pRAW-1", content="The answer.", tool_call_ids=[])
    s.add(_record("q", "call", raw="RAW-2"), "qRAW-2", content=None, tool_call_ids=["call_a"])
    msgs = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "The answer."},  # matched by content
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_a"}]},  # matched by its call id
        {"role": "assistant", "content": None},  # not ours: content as text
        {"role": "assistant", "content": [{"type": "text", "text": "parts"}]},
        {"role": "assistant", "content": "someone else's"},
    ]
    assert s.raw_messages(msgs) == [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "RAW-1"},
        {"role": "assistant", "content": "RAW-2"},
        {"role": "assistant", "content": ""},
        {"role": "assistant", "content": "parts"},
        {"role": "assistant", "content": "someone else's"},
    ]
    assert msgs[3] == {"role": "assistant", "content": None}  # the request is not modified


def test_an_ended_episode_refuses_with_409_and_keeps_the_first_reason():
    s = Session("s1", Sample(), budget=1)
    s.check_open()
    s.end("the agent returned")
    s.end("--agent-timeout 5 s")
    with pytest.raises(RequestError) as info:
        s.check_open()
    e = info.value
    assert (e.status, e.kind) == (409, "episode_ended")
    assert e.message.startswith("session s1: the episode ended (the agent returned); a request after the end")


def test_the_table_looks_up_open_sessions_and_counts_rejections():
    table = SessionTable()
    base = Sample(prompt="p", index=3)
    a, b = table.open(base, 8), table.open(base, 8)
    assert a.sid != b.sid and len(a.sid) == 32 and a.base is base and a.budget == 8
    assert table.lookup(a.sid) is a and table.rejected == 0
    with pytest.raises(RequestError) as info:
        table.lookup("nope")
    assert (info.value.status, info.value.kind) == (404, "unknown_session")
    assert info.value.message.startswith("unknown session 'nope': use the base_url the rollout handed to the agent")
    b.end("the agent raised")
    with pytest.raises(RequestError, match="the episode ended"):
        table.lookup(b.sid)
    assert table.rejected == 2
