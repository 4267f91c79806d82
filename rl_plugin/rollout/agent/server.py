"""The agent endpoint: an aiohttp server on the rollout manager's node, one port per run.

The port is bound once, when the manager is built (``AgentServer``: printed at start, kept
listening for the whole run); each rollout serves it from its own event loop (``serving``), the
loop its ``EngineRouter`` runs in, so every session's requests are batched with the others'
(``generate.EngineRouter``: seeded per flush, the context and ``--rollout-max-response-len``
clamps). Routes, per session:

    POST /sessions/{id}/v1/chat/completions     POST /sessions/{id}/v1/completions
    GET  /sessions/{id}/v1/models

(the agent's ``base_url`` is ``http://host:port/sessions/{id}``). Errors are OpenAI error objects
with the status of ``chat.RequestError`` (400 a field, 404 an unknown session, 409 an ended
episode, 500 the engine) and ``x-should-retry: false``, so the ``openai`` client does not retry
them; every request is answered or refused, none waits on an ended episode.
"""

from __future__ import annotations

import contextlib
import json
import socket
from typing import Any, AsyncIterator, Callable, Dict, Optional

from aiohttp import web

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

NO_RETRY = {"x-should-retry": "false"}
MODEL_NAME = "rl_plugin-policy"


def node_address() -> str:
    """The address agents reach this node at: Ray's node IP inside a Ray worker, else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - no Ray: a local run
        pass
    return "127.0.0.1"


class Serving:
    """One rollout's endpoint state: the sessions, the router, the template, the weight version."""

    def __init__(self, table: SessionTable, router: EngineRouter, template: ChatTemplate, version: Optional[int]):
        self.table, self.router, self.template, self.version = table, router, template, version

    async def generate(self, session: Session, ids, body, appended: bool):
        """One completion for ``session`` on prompt ``ids``: ``(record, finish_reason)``; the
        episode's budget bounds ``max_new_tokens``; nothing left: no engine call, no tokens."""
        sp = sampling_params(body, CHAT_KEYS if "messages" in body else COMPLETION_KEYS, self.template.stop_id_of)
        left = session.left
        if left <= 0:
            return TurnRecord(list(ids), [], [], "length", appended, self.version), "length"
        sp["max_new_tokens"] = min(sp.get("max_new_tokens", left), left)
        try:
            params = self.router.clamp(list(ids), sampling_params_of(sp, self.router.defaults))
        except ValueError as exc:
            raise RequestError(400, f"messages: {exc}", "messages") from None
        try:
            gen = await self.router.submit(list(ids), params)
        except Exception as exc:  # noqa: BLE001 - the engine's error, answered and re-raised by the rollout
            session.end(f"engine error: {exc}")
            raise RequestError(500, f"the engine failed: {exc}", kind="engine_error") from exc
        session.check_open()  # the episode ended while this generated (timeout): nothing recorded
        finish = "stop" if gen.finished else "length"
        return TurnRecord(
            list(ids), list(gen.response_ids), list(gen.log_probs), finish, appended, self.version
        ), finish

    async def chat(self, session: Session, body: Dict[str, Any]) -> Dict[str, Any]:
        tpl = self.template
        sampling_params(body, CHAT_KEYS, tpl.stop_id_of)  # refuse a bad request before rendering it
        messages = session.raw_messages(check_messages(body.get("messages")))
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        if tools is not None and not isinstance(tools, list):
            raise bad("tools", f"must be a list of tool objects, got {tools!r}")
        if body.get("tool_choice") not in (None, "auto", "none"):
            raise bad("tool_choice", f"only 'auto' and 'none' are served, got {body.get('tool_choice')!r}")
        text = tpl.render(messages, tools)
        ids, appended = session.prompt_ids(text, lambda: tpl.template_ids(messages, tools), tpl.encode)
        rec, finish = await self.generate(session, ids, body, appended)
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
            session.add(rec, tpl.decode(rec.full_ids, keep_special=True), content, rec.tool_call_ids)
            session.last_messages = list(body["messages"]) + [answer["choices"][0]["message"]]
        return answer

    async def completion(self, session: Session, body: Dict[str, Any]) -> Dict[str, Any]:
        tpl = self.template
        sampling_params(body, COMPLETION_KEYS, tpl.stop_id_of)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            ids, appended = session.prompt_ids(prompt, lambda: tpl.encode(prompt, special=True), tpl.encode)
        elif (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            ids, appended = list(prompt), session.ids_extend(list(prompt))
        else:
            raise bad("prompt", "must be a non-empty string or a list of token ids (one prompt per request)")
        rec, finish = await self.generate(session, ids, body, appended)
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


def _error(exc: RequestError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=NO_RETRY)


def _handler(method: str) -> Callable:
    async def handle(request: web.Request) -> web.Response:
        serving: Serving = request.app[SERVING]
        try:
            session = serving.table.lookup(request.match_info["sid"])
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise RequestError(400, "the request body is not JSON", None) from None
            if not isinstance(body, dict):
                raise RequestError(400, "the request body must be a JSON object", None)
            return web.json_response(await getattr(serving, method)(session, body))
        except RequestError as exc:
            return _error(exc)

    return handle


async def _models(request: web.Request) -> web.Response:
    serving: Serving = request.app[SERVING]
    try:
        serving.table.lookup(request.match_info["sid"])
    except RequestError as exc:
        return _error(exc)
    return web.json_response(
        {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "rl_plugin"}]}
    )


async def _unknown(request: web.Request) -> web.Response:
    exc = RequestError(404, f"no route {request.method} {request.path}; use base_url + '/v1/chat/completions'", None)
    return _error(exc)


SERVING = web.AppKey("serving", Serving)


class AgentServer:
    """The run's port (module docstring): bound at construction, served per rollout."""

    def __init__(self, host: Optional[str] = None, port: int = 0):
        self.host = host or node_address()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((self.host, int(port)))
        self.sock.listen(1024)
        self.port = int(self.sock.getsockname()[1])
        print(f"agent endpoint: http://{self.host}:{self.port}/sessions/<id>/v1 (one session per sample)", flush=True)

    def base_url(self, sid: str) -> str:
        return f"http://{self.host}:{self.port}/sessions/{sid}"

    @contextlib.asynccontextmanager
    async def serving(self, serving: Serving) -> AsyncIterator[Serving]:
        """Serve ``serving`` on the run's port in the running event loop until the block ends."""
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app[SERVING] = serving
        app.router.add_post("/sessions/{sid}/v1/chat/completions", _handler("chat"))
        app.router.add_post("/sessions/{sid}/v1/completions", _handler("completion"))
        app.router.add_get("/sessions/{sid}/v1/models", _models)
        app.router.add_route("*", "/{tail:.*}", _unknown)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        # a duplicate of the listening socket: the site closes its own, the run's stays bound
        site = web.SockSite(runner, self.sock.dup())
        await site.start()
        try:
            yield serving
        finally:
            await runner.cleanup()

    def close(self) -> None:
        self.sock.close()
