"""One rollout's endpoint state and its two completions (``server`` routes the requests here).

``Serving`` holds the rollout's sessions, its ``EngineRouter``, the chat template, the weight
version and the model's vocabulary size. A request is three steps:

1. off the event loop (``off_loop``: the one template thread): check the fields, render the
   chat, tokenise, apply the session's append-only rule (``sessions``), check every id the
   request names (prompt ids, ``stop_token_ids``) against the vocabulary: ``[0, vocab_size)``,
   a 400 naming the id and its place (an id past the embedding would fail every request batched
   with it, and on a GPU poison the engine with a device-side assert);
2. on the loop: reserve the episode's budget (``Session.reserve``), one engine call through the
   router, settle the budget;
3. off the loop again: decode, parse tool calls, record the completion, build the answer.

An engine that raises is answered 500 and kept in ``failure`` (the first one), which the rollout
re-raises naming the sample, so the agent is not blamed for it (``rollout.AgentRollout``).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any, Dict, List, Optional, Sequence, Tuple

from rl_plugin.rollout.agent.chat import (
    CHAT_KEYS,
    COMPLETION_KEYS,
    RequestError,
    bad,
    chat_answer,
    check_messages,
    completion_answer,
    parse_tool_calls,
    sampling_params,
)
from rl_plugin.rollout.agent.records import TurnRecord
from rl_plugin.rollout.agent.sessions import Session, SessionTable
from rl_plugin.rollout.agent.template import ChatTemplate
from rl_plugin.rollout.generate import EngineRouter, sampling_params_of

MODEL_NAME = "rl_plugin-policy"


def check_vocab(ids: Sequence[int], vocab_size: Optional[int], param: str) -> None:
    """400 naming the first id of ``ids`` outside ``[0, vocab_size)`` (None: no bound known)."""
    if vocab_size is None or not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return
    at, tid = next((k, t) for k, t in enumerate(ids) if not 0 <= t < vocab_size)
    raise bad(
        param,
        f"token id {tid} (position {at}) is outside the model's vocabulary [0, {vocab_size}); send ids the "
        "model's tokenizer produced",
    )


class Serving:
    """One rollout's endpoint state (module docstring)."""

    def __init__(
        self,
        table: SessionTable,
        router: EngineRouter,
        template: ChatTemplate,
        version: Optional[int],
        vocab_size: Optional[int] = None,
        pool: Optional[Executor] = None,
        images=None,
    ):
        self.table, self.router, self.template, self.version = table, router, template, version
        self.vocab_size, self.pool = vocab_size, pool
        self.images = images  # ``images.ChatImages`` in a run with images, else None
        self.failure: Optional[Tuple[BaseException, Session]] = None  # the first 500 (module docstring)

    async def off_loop(self, fn, *args):
        """``fn(*args)`` in the template thread (the server's one-thread pool)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def failed(self, exc: BaseException, session: Session) -> None:
        if self.failure is None:
            self.failure = (exc, session)

    async def generate(self, session: Session, ids: List[int], sp: Dict[str, Any], appended: bool):
        """One completion for ``session`` on prompt ``ids``: ``(record, finish_reason)``. The
        episode's budget is reserved first; nothing left: no engine call, no tokens."""
        if session.left <= 0:
            return TurnRecord(list(ids), [], [], "length", appended, self.version), "length"
        asked = min(sp.get("max_new_tokens", session.left), session.left)
        try:
            params = self.router.clamp(ids, sampling_params_of(dict(sp, max_new_tokens=asked), self.router.defaults))
        except ValueError as exc:
            raise RequestError(400, f"messages: {exc}", "messages") from None
        take = session.reserve(params.max_new_tokens)  # no await since `left` was read: atomic
        produced = 0
        try:
            gen = await self.router.submit(ids, params)
            produced = len(gen.response_ids)
        except Exception as exc:  # noqa: BLE001 - the engine's error, answered and re-raised by the rollout
            session.end(f"engine error: {exc}")
            self.failed(exc, session)
            raise RequestError(500, f"the engine failed: {exc}", kind="engine_error") from exc
        finally:
            session.settle(take, produced)
        session.check_open()  # the episode ended while this generated (timeout): nothing recorded
        finish = "stop" if gen.finished else "length"
        return TurnRecord(
            list(ids), list(gen.response_ids), list(gen.log_probs), finish, appended, self.version
        ), finish

    # -- /v1/chat/completions ---------------------------------------------------------------
    def _chat_prompt(self, session: Session, body: Dict[str, Any]):
        tpl = self.template
        sp = sampling_params(body, CHAT_KEYS, tpl.stop_id_of)  # refuse a bad request before rendering it
        check_vocab(sp["stop_token_ids"], self.vocab_size, "stop_token_ids")
        messages = session.raw_messages(check_messages(body.get("messages")))
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        if tools is not None and not isinstance(tools, list):
            raise bad("tools", f"must be a list of tool objects, got {tools!r}")
        if body.get("tool_choice") not in (None, "auto", "none"):
            raise bad("tool_choice", f"only 'auto' and 'none' are served, got {body.get('tool_choice')!r}")
        text = tpl.render(messages, tools)
        if self.images is not None:  # image_url parts: the processor's ids (``images``)
            ids, appended, images = self.images.prompt(session, text, messages)
            return ids, appended, sp, tools, images
        ids, appended = session.prompt_ids(text, lambda: tpl.template_ids(messages, tools), tpl.encode)
        return list(ids), appended, sp, tools, None

    def _chat_answer(self, session: Session, body, rec: TurnRecord, finish: str, tools) -> Dict[str, Any]:
        tpl = self.template
        shown = tpl.answer_ids(rec.output_ids, finish)
        rec.raw_text = tpl.decode(shown, keep_special=True)
        content, calls = parse_tool_calls(tpl.decode(shown, keep_special=False)) if tools else (None, [])
        if not calls:
            content = tpl.decode(shown, keep_special=False)
        rec.tool_call_ids = [c["id"] for c in calls]
        answer = chat_answer(
            content,
            calls,
            finish,
            rec.prompt_ids,
            rec.output_ids,
            rec.log_probs,
            tpl.token_texts(rec.output_ids) if body.get("logprobs") else [],
            want_logprobs=bool(body.get("logprobs")),
            want_prompt_ids=bool(body.get("return_prompt_token_ids")),
            model=MODEL_NAME,
        )
        if rec.output_ids:
            full = tpl.decode(rec.full_ids, keep_special=True)
            full = self.images.collapse(full) if self.images is not None else full  # compared with the next render
            session.add(rec, full, content, rec.tool_call_ids)
            session.last_messages = list(body["messages"]) + [answer["choices"][0]["message"]]
        return answer

    async def chat(self, session: Session, body: Dict[str, Any]) -> Dict[str, Any]:
        ids, appended, sp, tools, images = await self.off_loop(self._chat_prompt, session, body)
        rec, finish = await self.generate(session, ids, sp, appended)
        rec.images = images
        return await self.off_loop(self._chat_answer, session, body, rec, finish, tools)

    # -- /v1/completions ----------------------------------------------------------------------
    def _completion_prompt(self, session: Session, body: Dict[str, Any]):
        tpl = self.template
        sp = sampling_params(body, COMPLETION_KEYS, tpl.stop_id_of)
        check_vocab(sp["stop_token_ids"], self.vocab_size, "stop_token_ids")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            ids, appended = session.prompt_ids(prompt, lambda: tpl.encode(prompt, special=True), tpl.encode)
        elif (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            check_vocab(prompt, self.vocab_size, "prompt")
            ids, appended = list(prompt), session.ids_extend(list(prompt))
        else:
            raise bad("prompt", "must be a non-empty string or a list of token ids (one prompt per request)")
        if self.images is not None and self.images.image_id in ids:
            raise bad(
                "prompt",
                "image tokens reach the model only with their images: use /v1/chat/completions with image_url parts",
            )
        return list(ids), appended, sp

    def _completion_answer(self, session: Session, body, rec: TurnRecord, finish: str) -> Dict[str, Any]:
        tpl = self.template
        shown = tpl.answer_ids(rec.output_ids, finish)
        rec.raw_text = tpl.decode(shown, keep_special=True)
        text = tpl.decode(shown, keep_special=False)
        if rec.output_ids:
            session.add(rec, tpl.decode(rec.full_ids, keep_special=True), None, [])
        return completion_answer(
            text,
            finish,
            rec.prompt_ids,
            rec.output_ids,
            rec.log_probs,
            tpl.token_texts(rec.output_ids) if body.get("logprobs") is not None else [],
            want_logprobs=body.get("logprobs") not in (None, False),
            want_prompt_ids=bool(body.get("return_prompt_token_ids")),
            model=MODEL_NAME,
        )

    async def completion(self, session: Session, body: Dict[str, Any]) -> Dict[str, Any]:
        ids, appended, sp = await self.off_loop(self._completion_prompt, session, body)
        rec, finish = await self.generate(session, ids, sp, appended)
        return await self.off_loop(self._completion_answer, session, body, rec, finish)
