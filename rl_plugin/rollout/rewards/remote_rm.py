"""The remote reward model (``--rm-type remote_rm --rm-url URL``, slime's spelling).

Contract with the server: one HTTP ``POST URL`` per sample with the JSON body
``{"prompt": ..., "response": ..., "label": ..., "metadata": {...}}`` (``prompt`` is
``Sample.prompt``, slime's form: the dataset's prompt after the chat template with
``--apply-chat-template``, the string itself without; ``metadata`` is the ``--metadata-key``
object, ``{}`` without one). The answer is a JSON number, or an object carrying it under ``"reward"`` (or under
``--reward-key``); an object is kept whole as ``Sample.reward``.

Client behaviour (``aiohttp``, one session per ``score`` call):

- one client per process for a run's settings (``shared_client``): the ``--rm-type remote_rm``
  scorer and every ``remote_rm(args, sample)`` call (slime's helper, awaited inside a user's
  ``--custom-rm-path`` rm that reads the run's ``rm_url``) share it, so its bound covers them all;
- at most ``--rm-max-concurrency`` requests in flight (a semaphore per event loop and the
  connector's limit), across concurrent ``score`` calls in one event loop (a user rm called for
  every sample at once, a hook scoring sample by sample);
- each attempt times out after ``--rm-timeout`` seconds;
- a connection error, a timeout, HTTP 408, 429 or 5xx is retried up to ``--rm-max-retries``
  times, attempt ``k`` (0-based) waiting ``backoff * 2**k`` seconds first (capped at
  ``MAX_BACKOFF_S``); any other HTTP status, or an answer that is not JSON, fails at once;
- the first sample that keeps failing stops the rollout (the other requests are cancelled) with a
  ``RemoteRewardError`` naming the URL, the HTTP status or exception, and the sample (index, prompt).

``probe(url)`` is the start-up check (``rl_plugin.loop.preflight``): a TCP connection to the URL's
host and port, so a server that is down is named before Ray starts.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

from rl_plugin.registries import REMOTE_RM_DEFAULTS
from rl_plugin.urls import url_host_port

RETRY_STATUSES = frozenset({408, 429}) | frozenset(range(500, 600))
MAX_BACKOFF_S = 30.0
DEFAULT_MAX_CONCURRENCY, DEFAULT_TIMEOUT_S, DEFAULT_MAX_RETRIES = REMOTE_RM_DEFAULTS.values()
PROBE_TIMEOUT_S = 5.0


class RemoteRewardError(RuntimeError):
    """The reward server kept failing on a sample (or answered something that is not a reward)."""


def probe(url: str, timeout: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """``None`` when something accepts TCP connections at the URL's host:port, else why not
    (connection refused, unknown host, timed out) as one line."""
    host, port = url_host_port(url)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except socket.timeout:
        return f"no answer from {host}:{port} within {timeout:g} s"
    except OSError as exc:
        return f"cannot connect to {host}:{port}: {exc.strerror or exc}"


def _prompt_excerpt(prompt: Any, limit: int = 200) -> str:
    text = repr(prompt)
    return text if len(text) <= limit else text[:limit] + "...'"


class RemoteRewardModel:
    """Scores samples on the reward server at ``url`` (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_retries: int = DEFAULT_MAX_RETRIES,
        backoff: float = 0.5,
    ):
        url_host_port(url)  # a bad URL fails here, not in the first request
        self.url, self.max_concurrency, self.timeout = url, int(max_concurrency), float(timeout)
        self.max_retries, self.backoff = int(max_retries), float(backoff)
        self.retries = 0  # retried attempts since the last ``score`` call began
        # one semaphore per event loop: concurrent ``score`` calls in a loop share the bound (an
        # asyncio.Semaphore belongs to one loop; a loop that ends drops its entry)
        self._limits: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = (
            weakref.WeakKeyDictionary()
        )

    @classmethod
    def from_config(cls, config) -> "RemoteRewardModel":
        """From a ``RolloutConfig`` (an unset client setting, None, takes its default)."""

        def or_default(value, default):
            return default if value is None else value

        return cls(
            config.rm_url,
            max_concurrency=or_default(config.rm_max_concurrency, DEFAULT_MAX_CONCURRENCY),
            timeout=or_default(config.rm_timeout, DEFAULT_TIMEOUT_S),
            max_retries=or_default(config.rm_max_retries, DEFAULT_MAX_RETRIES),
        )

    async def score(self, samples: Sequence) -> List[Any]:
        """The server's answer for every sample, in order (a number or a dict, as returned)."""
        import aiohttp

        self.retries = 0
        if not samples:
            return []
        loop = asyncio.get_running_loop()
        limit = self._limits.get(loop)
        if limit is None:
            limit = self._limits[loop] = asyncio.Semaphore(self.max_concurrency)
        connector = aiohttp.TCPConnector(limit=self.max_concurrency)
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            tasks = [asyncio.ensure_future(self._one(session, limit, i, s)) for i, s in enumerate(samples)]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                failed = [t for t in tasks if t in done and t.exception() is not None]
                if failed:
                    raise failed[0].exception()
                return [t.result() for t in tasks]
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, session, limit: asyncio.Semaphore, index: int, sample) -> Any:
        import aiohttp

        payload = {
            "prompt": sample.prompt,
            "response": sample.response,
            "label": sample.label,
            "metadata": sample.metadata,
        }
        attempts = self.max_retries + 1
        why = ""
        for attempt in range(attempts):
            if attempt:
                self.retries += 1
                await asyncio.sleep(min(self.backoff * 2 ** (attempt - 1), MAX_BACKOFF_S))
            async with limit:
                try:
                    async with session.post(self.url, json=payload) as resp:
                        body = await resp.read()
                        status = resp.status
                except asyncio.TimeoutError:
                    why = f"timed out after {self.timeout:g} s (--rm-timeout)"
                    continue
                except aiohttp.ClientError as exc:
                    why = f"{type(exc).__name__}: {exc}"
                    continue
                except TypeError as exc:  # json.dumps of the payload
                    raise self._error(index, sample, f"the sample is not JSON-serialisable ({exc})", 1) from None
            if status in RETRY_STATUSES:
                why = f"HTTP {status}: {_text(body)}"
                continue
            if status >= 400:
                raise self._error(
                    index, sample, f"HTTP {status}: {_text(body)} (not retried: a client error)", attempt + 1
                )
            return self._parse(index, sample, status, body)
        raise self._error(index, sample, why, attempts)

    def _parse(self, index: int, sample, status: int, body: bytes) -> Any:
        import json

        try:
            return json.loads(body)
        except ValueError:
            raise self._error(index, sample, f"HTTP {status} with a body that is not JSON: {_text(body)}", 1) from None

    def _error(self, index: int, sample, why: str, attempts: int) -> RemoteRewardError:
        tries = f"after {attempts} attempt{'s' if attempts != 1 else ''} (--rm-max-retries {self.max_retries})"
        return RemoteRewardError(
            f"--rm-url {self.url}: the reward server failed on sample {index} of the rollout "
            f"(prompt {_prompt_excerpt(sample.prompt)}) {tries}: {why}. Fix: check that the server at --rm-url is up and "
            'answers POST {prompt, response, label, metadata} with a number or {"reward": x}; raise --rm-timeout '
            "or --rm-max-retries for a slow or flaky server"
        )


def _text(body: bytes, limit: int = 200) -> str:
    text = body.decode("utf-8", "replace").strip()
    return repr(text if len(text) <= limit else text[:limit] + "...")


_SHARED: Dict[Tuple[str, int, float, int], RemoteRewardModel] = {}
_SHARED_LOCK = threading.Lock()


def shared_client(config) -> RemoteRewardModel:
    """The process's one client for ``config``'s settings (a ``RolloutConfig``: ``rm_url``,
    ``rm_max_concurrency``, ``rm_timeout``, ``rm_max_retries``), built on first use: every caller
    with the same settings shares its concurrency bound."""
    client = RemoteRewardModel.from_config(config)
    key = (client.url, client.max_concurrency, client.timeout, client.max_retries)
    with _SHARED_LOCK:
        return _SHARED.setdefault(key, client)


async def remote_rm(args, sample) -> Any:
    """slime's ``remote_rm(args, sample)``: one sample's answer from the run's ``--rm-url``, through
    the process's shared client (``shared_client``: at most ``--rm-max-concurrency`` requests in
    flight over all calls). The registry entry of ``--rm-type remote_rm``, and usable inside a
    user's own ``rm(args, sample)`` (``--custom-rm-path`` with ``--rm-url``); ``args`` is the run's
    parsed flags, read through ``RolloutConfig`` (or that config itself)."""
    from rl_plugin.configs import RolloutConfig

    config = args if isinstance(args, RolloutConfig) else RolloutConfig.from_args(args)
    if config.rm_url is None:
        raise RemoteRewardError(
            "remote_rm(args, sample) was called without --rm-url: it POSTs the sample to the run's reward server. "
            "Fix: pass --rm-url http://HOST:PORT/PATH (with --custom-rm-path, or with --rm-type remote_rm)"
        )
    return (await shared_client(config).score([sample]))[0]
