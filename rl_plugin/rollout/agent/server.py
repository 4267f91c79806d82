"""The agent endpoint: an aiohttp server in its own thread and event loop, one port per run.

The port is bound once, when the manager is built (``AgentServer``: printed at start, kept
listening for the whole run), on loopback (127.0.0.1): the agents run in the rollout manager's
process, so nothing off the node needs to reach it. Its event loop runs in a thread of its own
(``rl_plugin-agent-endpoint``), not in the agents' loop: an agent that blocks its loop (a
synchronous HTTP client, ``time.sleep`` inside ``async def run_agent``) cannot starve the server,
so its own synchronous requests are answered and ``--agent-timeout`` still ends it
(``rollout.AgentRollout``). Each rollout serves its ``Serving`` there (``serving``); the
rollout's ``EngineRouter`` runs in that loop, so every session's requests are batched with the
others' (``generate.EngineRouter``: seeded per flush, the context and
``--rollout-max-response-len`` clamps). Rendering, tokenising, parsing a body and decoding run in
one worker thread beside the loop (``Serving.off_loop``: one, because a Hugging Face tokenizer is
not safe to call from several threads at once), so a large chat does not stall the other sessions.

Routes, per session, behind the run's token (a random 128-bit hex string, ``secrets``):

    POST /{token}/sessions/{id}/v1/chat/completions     POST /{token}/sessions/{id}/v1/completions
    GET  /{token}/sessions/{id}/v1/models

The agent's ``base_url`` is ``http://127.0.0.1:port/{token}/sessions/{id}``: the token travels in
the URL, so an unmodified OpenAI client (whatever its ``api_key``) reaches its session and
nothing without the URL does (a wrong or missing token: 401, checked in constant time; the
session id, uuid4, is a second secret). The printed address shows ``<token>``, never the token.

Errors are OpenAI error objects with the status of ``chat.RequestError`` (400 a field, a body
that is no JSON object, nested deeper than ``MAX_JSON_DEPTH`` or an id outside the vocabulary;
401 the token; 404 an unknown session; 409 an ended episode; 413 a body over
``MAX_REQUEST_BYTES``; 500 the engine or the endpoint itself) and ``x-should-retry: false``, so
the ``openai`` client does not retry them; every request is answered or refused, none waits on an
ended episode. A 500 is also kept (``Serving.failure``) and re-raised by the rollout naming the
sample: an engine failure is not the agent's fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import secrets
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterator

from aiohttp import web

from rl_plugin.rollout.agent.chat import RequestError
from rl_plugin.rollout.agent.serving import MODEL_NAME, Serving

NO_RETRY = {"x-should-retry": "false"}
LOOPBACK = "127.0.0.1"
# The largest body served. A request carries one chat: a 128k-token context is ~0.5 MB of text,
# JSON escaping and a tools list a few times that; 8 MiB leaves room for any context served here
# and is far below the 256 MB this endpoint took before (one request could hold that much memory).
MAX_REQUEST_BYTES = 8 * 1024 * 1024
# The deepest nesting of a body: OpenAI requests nest a handful of levels (a tool's JSON schema a
# few more); Python's json parser recurses per level, so a body nested 100k deep would raise
# RecursionError (a 500) instead of a 400.
MAX_JSON_DEPTH = 64
STOP_TIMEOUT_S = 30.0  # the most a rollout waits on the server's loop to start or stop serving


def _depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` nests deeper than ``limit`` (an explicit stack: no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > limit:
                return True
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False


def parse_body(raw: bytes) -> Dict[str, Any]:
    """A request body as a JSON object; ``RequestError`` 400 for anything else (module docstring)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError(400, "the request body is not JSON", None) from None
    except RecursionError:
        body = None
    if body is None or _depth_over(body, MAX_JSON_DEPTH):
        raise RequestError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", None)
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object", None)
    return body


def _error(exc: RequestError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=NO_RETRY)


def _handler(method: str) -> Callable:
    async def handle(request: web.Request) -> web.Response:
        serving: Serving = request.app[SERVING]
        session = None
        try:
            session = serving.table.lookup(request.match_info["sid"])
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise RequestError(
                    413, f"the request body is over {MAX_REQUEST_BYTES} bytes (the endpoint's limit)", None
                ) from None
            body = await serving.off_loop(parse_body, raw)
            return web.json_response(await getattr(serving, method)(session, body))
        except RequestError as exc:
            return _error(exc)
        except Exception as exc:  # noqa: BLE001 - the endpoint's own failure: answered, kept, re-raised by the rollout
            if session is not None:
                serving.failed(exc, session)
            return _error(
                RequestError(500, f"the agent endpoint failed: {type(exc).__name__}: {exc}", None, "server_error")
            )

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
TOKEN = web.AppKey("token", str)


@web.middleware
async def _guard(request: web.Request, handler) -> web.Response:
    """The run's token, the first path segment, compared in constant time (module docstring)."""
    first = request.path.lstrip("/").split("/", 1)[0]
    if not hmac.compare_digest(first.encode(), request.app[TOKEN].encode()):
        return _error(
            RequestError(
                401,
                "missing or wrong run token: use the base_url the rollout handed to the agent, as it is",
                None,
                "authentication_error",
            )
        )
    return await handler(request)


class AgentServer:
    """The run's port, its thread and event loop (module docstring): bound at construction,
    served per rollout (``serving``)."""

    def __init__(self, host: str = LOOPBACK, port: int = 0):
        self.host = host
        self.token = secrets.token_hex(16)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((self.host, int(port)))
        self.sock.listen(1024)
        self.port = int(self.sock.getsockname()[1])
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rl_plugin-agent-template")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rl_plugin-agent-endpoint", daemon=True)
        self.thread.start()
        print(
            f"agent endpoint: http://{self.host}:{self.port}/<run token>/sessions/<id>/v1 (one session per sample; "
            "each agent gets its base_url)",
            flush=True,
        )

    def base_url(self, sid: str) -> str:
        return f"http://{self.host}:{self.port}/{self.token}/sessions/{sid}"

    def _run(self, coro):
        """``coro`` on the server's loop, waited for from the calling thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(STOP_TIMEOUT_S)

    async def _start(self, serving: Serving) -> web.AppRunner:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[_guard])
        app[SERVING], app[TOKEN] = serving, self.token
        base = "/{token}/sessions/{sid}/v1"
        app.router.add_post(base + "/chat/completions", _handler("chat"))
        app.router.add_post(base + "/completions", _handler("completion"))
        app.router.add_get(base + "/models", _models)
        app.router.add_route("*", "/{tail:.*}", _unknown)
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        # a duplicate of the listening socket: the site closes its own, the run's stays bound
        await web.SockSite(runner, self.sock.dup()).start()
        return runner

    @contextlib.contextmanager
    def serving(self, serving: Serving) -> Iterator[Serving]:
        """Serve ``serving`` on the run's port, in the server's loop, until the block ends."""
        serving.pool = self.pool
        runner = self._run(self._start(serving))
        try:
            yield serving
        finally:
            self._run(runner.cleanup())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(STOP_TIMEOUT_S)
        self.pool.shutdown(wait=False)
        self.sock.close()
