"""Agent sessions: one per sample, opened by the rollout, ended when its agent returns.

A session owns its completions' records (``records.TurnRecord``), its episode budget of model
tokens (``--rollout-max-response-len`` per episode: a request asks at most what is left; with
nothing left it is answered at once with no tokens and finish_reason "length") and the token-in /
token-out rule that makes a turn append-only. The budget is *reserved* before the engine call
(``reserve`` / ``settle``, on the endpoint's event loop, with no await between the check and the
reservation): requests in flight together on one session share what is left instead of each
seeing all of it, so the episode never generates more than its budget.

The append-only rule:

- a turn's messages are rendered by the chat template to text ``T``;
- when ``T`` starts with the text of the previous record's prompt + output ids (decoded, special
  tokens kept), the prompt ids are those ids, exactly as the engine produced them, followed by the
  tokenisation of the rest of ``T`` (what the agent and the template added): the turn is
  ``appended``;
- otherwise (the agent rewrote the history, the template re-rendered an earlier turn) the prompt
  ids are the template's tokenisation of ``T``, and the turn starts a new sample.

An assistant message the agent sends back is rendered from the raw text the model produced when
it is one of this session's answers (matched by its tool-call ids, or by its content): a template
that re-formats ``tool_calls`` its own way would otherwise break the append.

A request to an unknown session is a 404; to a session whose episode ended (the agent returned,
raised or ran out of ``--agent-timeout``) a 409. Session ids are random (uuid4).
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

from rl_plugin.rollout.agent.chat import RequestError, text_of
from rl_plugin.rollout.agent.records import TurnRecord
from rl_plugin.rollout.sample import Sample


class Session:
    """One episode's state (module docstring)."""

    def __init__(self, sid: str, base: Sample, budget: int):
        self.sid, self.base, self.budget = sid, base, int(budget)
        self.records: List[TurnRecord] = []
        self.spent = 0  # output ids the engine produced for this episode (recorded or not)
        self.reserved = 0  # output ids asked by the engine calls in flight
        self.ended: Optional[str] = None  # why the episode ended (None: open)
        self.last_messages: List[Dict[str, Any]] = []
        self.last_answer: Optional[Dict[str, Any]] = None
        self._texts: List[str] = []  # per record: its prompt + output decoded, special tokens kept
        self._raw_by_call: Dict[str, str] = {}
        self._raw_by_content: Dict[str, str] = {}
        self.image_cache: Dict[str, Any] = {}  # image_url -> its opened image (``images.ChatImages``)

    @property
    def left(self) -> int:
        """Model tokens a new request may still ask: the budget less what was generated and what
        the calls in flight reserved."""
        return max(self.budget - self.spent - self.reserved, 0)

    def reserve(self, asked: int) -> int:
        """Reserve at most ``asked`` of what is left; returns the reservation (0: nothing left)."""
        take = min(int(asked), self.left)
        self.reserved += take
        return take

    def settle(self, reserved: int, produced: int) -> None:
        """An engine call that reserved ``reserved`` ended having produced ``produced`` ids."""
        self.reserved -= reserved
        self.spent += produced

    def check_open(self) -> None:
        if self.ended is not None:
            raise RequestError(
                409,
                f"session {self.sid}: the episode ended ({self.ended}); a request after the end is not served "
                "(open a new episode: the rollout hands the agent a new base_url per sample)",
                kind="episode_ended",
            )

    def raw_messages(self, messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """``messages`` with this session's own answers as the model wrote them (module docstring)."""
        out = []
        for m in messages:
            if m.get("role") == "assistant":
                ids = [c.get("id") for c in m.get("tool_calls") or [] if isinstance(c, dict)]
                raw = next((self._raw_by_call[i] for i in ids if i in self._raw_by_call), None)
                if raw is None and isinstance(m.get("content"), str):
                    raw = self._raw_by_content.get(m["content"])
                if raw is not None:
                    out.append({"role": "assistant", "content": raw})
                    continue
                if m.get("content") is None or not isinstance(m.get("content"), str):
                    m = dict(m, content=text_of(m.get("content")))
            out.append(m)
        return out

    def prompt_ids(
        self, text: str, full_ids: Callable[[], List[int]], encode: Callable[[str], List[int]]
    ) -> Tuple[List[int], bool]:
        """``(prompt ids, appended)`` of a turn rendered as ``text`` (module docstring);
        ``full_ids()`` is the template's tokenisation of the whole text, ``encode`` a piece's."""
        if self.records:
            before = self._texts[-1]
            if text.startswith(before):
                return self.records[-1].full_ids + (
                    encode(text[len(before) :]) if len(text) > len(before) else []
                ), True
        return full_ids(), False

    def ids_extend(self, ids: List[int]) -> bool:
        """True when ``ids`` (a completion request's own ids) extend the previous prompt + output."""
        if not self.records:
            return False
        prev = self.records[-1].full_ids
        return len(ids) >= len(prev) and ids[: len(prev)] == prev

    def add(self, record: TurnRecord, full_text: str, content: Optional[str], tool_call_ids: List[str]) -> None:
        """Record one completion; ``full_text`` its prompt + output decoded (special tokens kept)."""
        self.records.append(record)
        self._texts.append(full_text)
        for i in tool_call_ids:
            self._raw_by_call[i] = record.raw_text
        if content is not None and not tool_call_ids:
            self._raw_by_content[content] = record.raw_text

    def end(self, why: str) -> None:
        if self.ended is None:
            self.ended = why


class SessionTable:
    """The rollout's sessions by id; ``rejected`` counts the requests answered 404 / 409."""

    def __init__(self):
        self.sessions: Dict[str, Session] = {}
        self.rejected = 0

    def open(self, base: Sample, budget: int) -> Session:
        sid = uuid.uuid4().hex
        self.sessions[sid] = s = Session(sid, base, budget)
        return s

    def lookup(self, sid: str) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            self.rejected += 1
            raise RequestError(
                404,
                f"unknown session {sid!r}: use the base_url the rollout handed to the agent (a session lives for one "
                "episode of one rollout)",
                kind="unknown_session",
            )
        try:
            s.check_open()
        except RequestError:
            self.rejected += 1
            raise
        return s
